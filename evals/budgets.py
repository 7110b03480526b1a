"""Quality against thinking budget: one row per (model, budget) from run folders that differ
only in their thinking budget. This is the table tenants tune `thinking_budget` from.

Every row is over the questions that every folder answered (a mixed run's questions of the
chosen kind count too, so a budget-0 row can come from the main eval), so rows compare.
Writes budgets.json, budgets.md and budgets.png into the output folder.

Beside the fixed rows: the oracle over them (per question, the cheapest answer of any row
that is right: the ceiling of any router among these arms), and the routed modes the folders
ran (the arms router choosing model and thinking per question, served for real); each row
also as a share of the best fixed row's exact match, dollars and thinking tokens.

With a trained router, also the policies a tenant can set: thinking tokens per difficulty,
the model chosen by the classifier (router.policy.goes_large), each question answered as its
(model, budget) run answered it. Greedy answers are deterministic, so this is what the
policy would have produced; it shows which budgets per difficulty spend fewer thinking
tokens than one fixed budget for the same exact match.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evals.records import Record, RecordLog  # noqa: E402
from evals.report import share, verdict  # noqa: E402
from evals.runner import MODES, RECORDS_FILE, ROUTED_MODES, RunError, read_config  # noqa: E402
from evals.summary import TARGET, difficulty_probabilities, ratio  # noqa: E402
from router.data import DIFFICULTIES  # noqa: E402
from router.policy import goes_large  # noqa: E402

# The thinking arms' promise: the best arm's quality (TARGET of its exact match, the tolerance
# the cascade's own target allows) at this share of its dollars, and of its thinking tokens.
DOLLAR_TARGET = 0.5
THINKING_TARGET = 0.5


@dataclass
class BudgetRun:
    """One model's answers at one thinking budget, in question-id order."""
    folder: Path
    model: str                  # the model's source, as the run names it
    mode: str
    budget: int
    records: list[Record]
    early_exit: bool = False    # served with early exit from thinking (engine/early_exit.py)


def read_runs(folders: list[Path], kind: str = "gsm8k", budget: str = "thinking_budget") -> list[BudgetRun]:
    """Each folder's small and large answers of `kind`, on the questions every one of them
    and every routed mode of theirs answered (a run stopped at --limit N covers its first N);
    `budget` names the run setting the folders differ in (thinking_budget or context_budget)."""
    runs, routed = [], []
    for folder in folders:
        config = read_config(folder)
        log = RecordLog(folder / RECORDS_FILE)
        for mode in [m for m in MODES if m in log.modes()]:
            records = [r for r in log.of_mode(mode) if r.kind == kind]
            if records:
                exits = config.thinking_exit is not None and not config.thinking_exit.observe
                runs.append(BudgetRun(folder, config.models[MODES[mode].model], mode, getattr(config, budget),
                                      records, exits))
        answered = ({r.id for r in log.of_mode(m) if r.kind == kind} for m in ROUTED_MODES if m in log.modes())
        routed += [ids for ids in answered if ids]      # a routed mode with none of this kind limits nothing
    if not runs:
        raise RunError(f"no {kind} answers in {', '.join(map(str, folders))}")
    shared = set.intersection(*({r.id for r in run.records} for run in runs), *routed)
    if not shared:
        raise RunError(f"no {kind} question was answered in every one of {', '.join(map(str, folders))}")
    for run in runs:
        run.records = sorted((r for r in run.records if r.id in shared), key=lambda r: r.id)
    return sorted(runs, key=lambda r: (list(MODES).index(r.mode), r.budget, r.early_exit))


def budget_rows(runs: list[BudgetRun]) -> list[dict]:
    return [_row(run.mode + " + early exit" * run.early_exit, run.model, run.budget, run.records, run.folder)
            for run in runs]


def _row(mode: str, model: str, budget: int | None, records: list[Record], folder: Path | None) -> dict:
    thinking = np.array([r.tokens("thinking") for r in records])
    probes = np.array([r.tokens("probe") for r in records])
    return {"model": model, "mode": mode, "budget": budget,
            "questions": len(records), "em": float(np.mean([r.em for r in records])),
            # Early exit's probes count as thinking spent.
            "thinking_tokens": float((thinking + probes).mean()), "probe_tokens": float(probes.mean()),
            "output_tokens": float(np.mean([r.tokens("output") for r in records])),
            # Spans the engine cut at the budget (budget forcing) rather than the model closed.
            "forced_share": float((thinking >= budget).mean()) if budget else 0.0,
            "engine_s": float(np.mean([r.engine_s for r in records])),
            "cost_per_1k": 1000 * float(np.mean([r.cost for r in records])),
            "folder": str(folder) if folder else None}


def oracle_row(runs: list[BudgetRun]) -> dict:
    """Per question, the cheapest answer among the runs' that is right (the cheapest of all
    where none is): what a router that knew the answers would pay among these arms."""
    picked = []
    for answers in zip(*(run.records for run in runs)):
        right = [r for r in answers if r.correct]
        picked.append(min(right or answers, key=lambda r: r.cost))
    return _row("oracle", "cheapest right answer", None, picked, None)


def routed_rows(folders: list[Path], kind: str, questions: set[str]) -> list[dict]:
    """The routed modes the folders ran, over the same questions as the fixed rows (read_runs
    keeps only questions they answered too)."""
    rows = []
    for folder in folders:
        log = RecordLog(folder / RECORDS_FILE)
        for mode in [m for m in ROUTED_MODES if m in log.modes()]:
            records = sorted((r for r in log.of_mode(mode) if r.kind == kind and r.id in questions), key=lambda r: r.id)
            rows.append(_row(mode, "arms router", None, records, folder))
    return rows


def against_best(rows: list[dict], best: dict) -> None:
    """Each row's exact match, dollars and thinking tokens as shares of the best fixed row's,
    and whether it meets the thinking arms' targets at the best row's quality."""
    for r in rows:
        v = r["vs_best"] = {"em": ratio(r["em"], best["em"]), "cost": ratio(r["cost_per_1k"], best["cost_per_1k"]),
                            "thinking": ratio(r["thinking_tokens"], best["thinking_tokens"])}
        equal = v["em"] is not None and v["em"] >= TARGET
        r["targets"] = {"dollars": equal and v["cost"] is not None and v["cost"] <= DOLLAR_TARGET,
                        "thinking": equal and v["thinking"] is not None and v["thinking"] <= THINKING_TARGET}


def policy_table(runs: list[BudgetRun], router, embedder) -> dict:
    """Every thinking budget per difficulty the runs cover (one fixed budget for all among
    them), the classifier choosing the model; each with its exact match, thinking tokens and
    cost. Returns {"verdicts": difficulty -> questions, "rows": [...]}."""
    answers = {(r.mode, r.budget): r.records for r in runs if not r.early_exit}   # the fixed budgets
    budgets = sorted({r.budget for r in runs})
    if not all((m, b) in answers for m in ("small", "large") for b in budgets):
        raise RunError("a policy needs both models' answers at every budget")
    labels = [max(p, key=p.get) for p in difficulty_probabilities(router, embedder, runs[0].records)]
    rows = []
    for combo in itertools.product(budgets, repeat=len(DIFFICULTIES)):
        per = dict(zip(DIFFICULTIES, combo))
        picked = [answers[("large" if goes_large(label, per["hard"]) else "small", per[label])][i]
                  for i, label in enumerate(labels)]
        fixed = len(set(combo)) == 1
        rows.append({"policy": f"fixed {combo[0]}" if fixed else " / ".join(map(str, combo)),
                     "budgets": per, "fixed": fixed,
                     "em": float(np.mean([r.em for r in picked])),
                     "thinking_tokens": float(np.mean([r.tokens("thinking") for r in picked])),
                     "large_share": float(np.mean([r.calls[0].model == "large" for r in picked])),
                     "cost_per_1k": 1000 * float(np.mean([r.cost for r in picked]))})
    rows.sort(key=lambda r: (r["thinking_tokens"], -r["em"]))
    best = -1.0
    for r in rows:                  # the Pareto front: no policy has more EM for fewer thinking tokens
        r["pareto"] = r["em"] > best
        best = max(best, r["em"])
    return {"verdicts": {d: labels.count(d) for d in DIFFICULTIES}, "rows": rows}


def policy_markdown(table: dict, kind: str) -> str:
    rows, counts = table["rows"], table["verdicts"]
    lines = ["", "## Thinking budgets by difficulty", "",
             f"The classifier's difficulty picks the model (router.policy) and the budget; each {kind} question "
             "is answered as that model answered it at that budget. Classifier's verdicts on these questions: "
             + ", ".join(f"{d} {counts.get(d, 0)}" for d in DIFFICULTIES) + ". Shown: every fixed budget and "
             "the policies no other beats on both exact match and thinking tokens.", "",
             "| budgets (easy / medium / hard) | EM | thinking tokens | to large | $ / 1k |", "|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['em']:.3f} | {r['thinking_tokens']:.0f} | {r['large_share']:.2f} "
              f"| {r['cost_per_1k']:.4f} |" for r in rows if r["fixed"] or r["pareto"]]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], kind: str, best: dict) -> str:
    lines = [f"# {kind} exact match by thinking budget", "",
             f"{rows[0]['questions']} questions, the same in every row; tokens and engine seconds are means per "
             "question (thinking tokens include early exit's probes); forced: share of thinking spans the engine "
             "closed at the budget. Engine seconds are a "
             "share of batched steps, so they depend on each run's concurrency and mix: compare them within "
             "a run, not across rows from different runs. The oracle takes, per question, the cheapest right "
             "answer of the fixed rows; a routed row is the arms router served for real. \"vs best\": exact "
             f"match, dollars and thinking tokens as shares of the best fixed row's, {best['mode']} at "
             f"{best['budget']}. Targets, at {TARGET:.0%} of the best row's exact match or more: its dollars "
             f"at {DOLLAR_TARGET:.0%} or less, and its thinking tokens at {THINKING_TARGET:.0%} or less.", "",
             "| model | budget | EM | thinking tokens | output tokens | forced | engine s / q | $ / 1k "
             "| EM / $ / thinking vs best | target $ / thinking |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} (`{r['model']}`) | {'–' if r['budget'] is None else r['budget']} | {r['em']:.3f} "
              f"| {r['thinking_tokens']:.0f} | {r['output_tokens']:.0f} "
              f"| {'–' if r['budget'] is None else format(r['forced_share'], '.2f')} | {r['engine_s']:.2f} "
              f"| {r['cost_per_1k']:.4f} | {share(r['vs_best']['em'])} / {share(r['vs_best']['cost'])} / "
              f"{share(r['vs_best']['thinking'])} | {verdict(r['targets']['dollars'])} / "
              f"{verdict(r['targets']['thinking'])} |" for r in rows]
    return "\n".join(lines) + "\n"


def write_budget_table(folders: list[Path], out: Path, kind: str = "gsm8k", router=None, embedder=None) -> str:
    runs = read_runs(folders, kind)
    rows = budget_rows(runs)
    best = max(rows, key=lambda r: (r["em"], -r["cost_per_1k"]))
    extra = [oracle_row(runs)] + routed_rows(folders, kind, {r.id for r in runs[0].records})
    against_best(rows + extra, best)
    policies = policy_table(runs, router, embedder) if router is not None else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "budgets.json").write_text(json.dumps({"kind": kind, "rows": rows, "oracle": extra[0], "routed": extra[1:],
                                                  "policies": policies}, indent=2) + "\n")
    text = markdown(rows + extra, kind, best) + (policy_markdown(policies, kind) if policies else "")
    (out / "budgets.md").write_text(text)
    fig, ax = plt.subplots(figsize=(6, 4))
    if policies:
        front = [r for r in policies["rows"] if r["pareto"]]
        ax.scatter([r["thinking_tokens"] for r in policies["rows"]], [r["em"] for r in policies["rows"]],
                   s=8, color="0.75", label="routed, budgets by difficulty")
        ax.plot([r["thinking_tokens"] for r in front], [r["em"] for r in front], "k:", lw=1, label="their front")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["thinking_tokens"] for r in mine], [r["em"] for r in mine], "o-", label=mode)
        for r in mine:
            ax.annotate(str(r["budget"]), (r["thinking_tokens"], r["em"]), textcoords="offset points", xytext=(4, -10))
    for r in extra:
        ax.plot([r["thinking_tokens"]], [r["em"]], "*", ms=10, label=r["mode"])
    save_plot(fig, ax, out / "budgets.png", "thinking tokens per question (mean)", f"{kind} exact match",
              "Exact match by thinking budget (labels: budget)")
    return text


def save_plot(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """A one-axis curve plot labelled, gridded, with its legend, written as a PNG and closed."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
