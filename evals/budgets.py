"""Quality against thinking budget: one row per (model, budget) from run folders that differ
only in their thinking budget. This is the table tenants tune `thinking_budget` from.

Every folder must hold the same questions (a mixed run's questions of the chosen kind count
too, so a budget-0 row can come from the main eval), or the rows would not be comparable.
Writes budgets.json, budgets.md and budgets.png into the output folder.
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evals.records import RecordLog  # noqa: E402
from evals.runner import MODES, RECORDS_FILE, RunError, read_config  # noqa: E402


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


def markdown(rows: list[dict], kind: str) -> str:
    lines = [f"# {kind} exact match by thinking budget", "",
             f"{rows[0]['questions']} questions, the same in every row; tokens and engine seconds are means per "
             "question; forced: share of thinking spans the engine closed at the budget.", "",
             "| model | budget | EM | thinking tokens | output tokens | forced | engine s / q | $ / 1k |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} (`{r['model']}`) | {r['budget']} | {r['em']:.3f} | {r['thinking_tokens']:.0f} "
              f"| {r['output_tokens']:.0f} | {r['forced_share']:.2f} | {r['engine_s']:.2f} | {r['cost_per_1k']:.4f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def write_budget_table(folders: list[Path], out: Path, kind: str = "gsm8k") -> str:
    rows = budget_rows(folders, kind)
    out.mkdir(parents=True, exist_ok=True)
    (out / "budgets.json").write_text(json.dumps({"kind": kind, "rows": rows}, indent=2) + "\n")
    text = markdown(rows, kind)
    (out / "budgets.md").write_text(text)
    fig, ax = plt.subplots(figsize=(6, 4))
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
