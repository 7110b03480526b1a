"""Quality against thinking budget: one row per (model, budget) from run folders that differ
only in their thinking budget. This is the table tenants tune `thinking_budget` from.

Every folder must hold the same questions (a mixed run's questions of the chosen kind count
too, so a budget-0 row can come from the main eval), or the rows would not be comparable.
Writes budgets.json, budgets.md and budgets.png into the output folder.

With a trained router, also the policies a tenant can set: thinking tokens per difficulty,
the model chosen by the classifier (router.policy.goes_large), each question answered as its
(model, budget) run answered it. Greedy answers are deterministic, so this is what the
policy would have produced; it shows which budgets per difficulty spend fewer thinking
tokens than one fixed budget for the same exact match.
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evals.records import Record, RecordLog  # noqa: E402
from evals.runner import MODES, RECORDS_FILE, RunError, read_config  # noqa: E402
from router.policy import goes_large  # noqa: E402

DIFFICULTIES = ("easy", "medium", "hard")


def _answers(folders: list[Path], kind: str) -> dict[tuple[str, int], list[Record]]:
    """(mode, budget) -> the records of `kind`, in question-id order."""
    out = {}
    for folder in folders:
        budget = read_config(folder).thinking_budget
        log = RecordLog(folder / RECORDS_FILE)
        for mode in [m for m in MODES if m in log.modes()]:
            records = sorted((r for r in log.of_mode(mode) if r.kind == kind), key=lambda r: r.id)
            if records:
                out[(mode, budget)] = records
    return out


def budget_rows(folders: list[Path], kind: str = "gsm8k") -> list[dict]:
    rows, questions = [], None
    for folder in folders:
        config = read_config(folder)
        log = RecordLog(folder / RECORDS_FILE)
        for mode in [m for m in MODES if m in log.modes()]:
            records = [r for r in log.of_mode(mode) if r.kind == kind]
            if not records:
                continue
            ids = {r.id for r in records}
            if questions is None:
                questions = ids
            elif ids != questions:
                raise RunError(f"{folder}: its {mode} run answered {len(ids)} {kind} questions, "
                               f"{len(ids ^ questions)} of them not shared with the first folder's "
                               f"{len(questions)}; the rows must come from the same questions")
            thinking = np.array([r.tokens("thinking") for r in records])
            budget = config.thinking_budget
            rows.append({"model": config.models[MODES[mode].model], "mode": mode, "budget": budget,
                         "questions": len(records), "em": float(np.mean([r.em for r in records])),
                         "thinking_tokens": float(thinking.mean()),
                         "output_tokens": float(np.mean([r.tokens("output") for r in records])),
                         # Spans the engine cut at the budget (budget forcing) rather than the model closed.
                         "forced_share": float((thinking >= budget).mean()) if budget else 0.0,
                         "engine_s": float(np.mean([r.engine_s for r in records])),
                         "cost_per_1k": 1000 * float(np.mean([r.cost for r in records])),
                         "folder": str(folder)})
    if not rows:
        raise RunError(f"no {kind} answers in {', '.join(map(str, folders))}")
    return sorted(rows, key=lambda r: (list(MODES).index(r["mode"]), r["budget"]))


def policy_table(folders: list[Path], router, embedder, kind: str = "gsm8k") -> dict:
    """Every thinking budget per difficulty the runs cover (one fixed budget for all among
    them), the classifier choosing the model; each with its exact match, thinking tokens and
    cost. Returns {"verdicts": difficulty -> questions, "rows": [...]}."""
    answers = _answers(folders, kind)
    budgets = sorted({b for _, b in answers})
    if not all((m, b) in answers for m in ("small", "large") for b in budgets):
        raise RunError("a policy needs both models' answers at every budget")
    first = answers[("small", budgets[0])]
    vectors = embedder.encode([r.question for r in first])
    labels = [max(p, key=p.get) for p in (router.classifier.probabilities(r.question, v, r.retrieval_scores)
                                          for r, v in zip(first, vectors))]
    rows = []
    for per in ({d: b for d, b in zip(DIFFICULTIES, combo)} for combo in np.array(np.meshgrid(
            budgets, budgets, budgets, indexing="ij")).reshape(3, -1).T.tolist()):
        picked = [answers[("large" if goes_large(label, per["hard"]) else "small", per[label])][i]
                  for i, label in enumerate(labels)]
        fixed = len(set(per.values())) == 1
        rows.append({"policy": f"fixed {per['easy']}" if fixed else
                     " / ".join(str(per[d]) for d in DIFFICULTIES), "budgets": per, "fixed": fixed,
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


def markdown(rows: list[dict], kind: str) -> str:
    lines = [f"# {kind} exact match by thinking budget", "",
             f"{rows[0]['questions']} questions, the same in every row; tokens and engine seconds are means per "
             "question; forced: share of thinking spans the engine closed at the budget. Engine seconds are a "
             "share of batched steps, so they depend on each run's concurrency and mix: compare them within "
             "a run, not across rows from different runs.", "",
             "| model | budget | EM | thinking tokens | output tokens | forced | engine s / q | $ / 1k |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} (`{r['model']}`) | {r['budget']} | {r['em']:.3f} | {r['thinking_tokens']:.0f} "
              f"| {r['output_tokens']:.0f} | {r['forced_share']:.2f} | {r['engine_s']:.2f} | {r['cost_per_1k']:.4f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def write_budget_table(folders: list[Path], out: Path, kind: str = "gsm8k", router=None, embedder=None) -> str:
    rows = budget_rows(folders, kind)
    policies = policy_table(folders, router, embedder, kind) if router is not None else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "budgets.json").write_text(json.dumps({"kind": kind, "rows": rows, "policies": policies}, indent=2) + "\n")
    text = markdown(rows, kind) + (policy_markdown(policies, kind) if policies else "")
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
    ax.set_xlabel("thinking tokens per question (mean)")
    ax.set_ylabel(f"{kind} exact match")
    ax.set_title("Exact match by thinking budget (labels: budget)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "budgets.png", dpi=120)
    plt.close(fig)
    return text
