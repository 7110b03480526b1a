"""Quality against context budget: one row per (model, budget) from run folders that differ
only in their context budget (e.g. `eval run squad -n 40 --context-budget B` for B in 256,
512, 1024, 2048). A small model can drown in passages that a large one reads well, so each
arm of the router carries the budget its model's curve chooses (router.arms).

Writes context.json (rows and the chosen budget per model), context.md and context.png.
`chosen`: per model, the smallest budget whose quality trails that model's best by no more
than one standard error of the per-question difference (the one-standard-error rule). On 40
questions a gap of 0.03 F1 is noise, and the smaller budget is the cheaper arm: a fixed slack
picked the large model's 2,048 tokens for 0.027 F1 over 512 (standard error 0.055), at 2.7
times the dollars.
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evals.budgets import read_runs, save_plot  # noqa: E402
from evals.runner import RunError  # noqa: E402

CONTEXT_FILE = "context.json"


def context_rows(folders: list[Path], kind: str = "squad") -> list[dict]:
    """One row per (model, budget); `gap` is the model's best quality minus the row's, paired
    by question, and `gap_se` its standard error."""
    runs = read_runs(folders, kind, "context_budget")
    scores = {(run.mode, run.budget): {r.id: r.score for r in run.records} for run in runs}
    best = {}
    for (mode, budget), by_id in scores.items():
        if mode not in best or np.mean(list(by_id.values())) > np.mean(list(best[mode].values())):
            best[mode] = by_id
    rows = []
    for run in runs:
        rs = run.records
        gap = np.array([best[run.mode][q] - s for q, s in scores[run.mode, run.budget].items()])
        rows.append({"model": run.model, "mode": run.mode, "budget": run.budget, "questions": len(rs),
                     "quality": float(np.mean([r.score for r in rs])), "em": float(np.mean([r.em for r in rs])),
                     "gap": float(gap.mean()),
                     "gap_se": float(gap.std(ddof=1) / np.sqrt(len(gap))) if len(gap) > 1 else 0.0,
                     "passages": float(np.mean([r.passages for r in rs])),
                     "prompt_tokens": float(np.mean([r.tokens("prompt") for r in rs])),
                     "cost_per_1k": 1000 * float(np.mean([r.cost for r in rs])),
                     "engine_s": float(np.mean([r.engine_s for r in rs])), "folder": str(run.folder)})
    return rows


def chosen(rows: list[dict]) -> dict[str, int]:
    """Per model, the smallest budget whose gap to the model's best is within its standard error."""
    return {mode: min(r["budget"] for r in rows if r["mode"] == mode and r["gap"] <= r["gap_se"])
            for mode in dict.fromkeys(r["mode"] for r in rows)}


def markdown(rows: list[dict], picked: dict[str, int], kind: str) -> str:
    lines = [f"# {kind} quality by context budget", "",
             f"{rows[0]['questions']} questions, the same in every row, answered from retrieval trimmed to the "
             "budget (prompt tokens: instructions, passages and question). Quality: mean F1. Chosen per model "
             "(the arm's context budget): the smallest budget whose F1 trails the model's best by no more than "
             "one standard error of the per-question difference: " + ", ".join(f"{m} {b}" for m, b in picked.items())
             + ".", "",
             "| model | budget | F1 | gap to best (± SE) | EM | passages | prompt tokens | engine s / q | $ / 1k |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} (`{r['model']}`) "
              f"| {r['budget']}{' (chosen)' if picked[r['mode']] == r['budget'] else ''} "
              f"| {r['quality']:.3f} | {r['gap']:.3f} ± {r['gap_se']:.3f} | {r['em']:.3f} | {r['passages']:.1f} "
              f"| {r['prompt_tokens']:.0f} "
              f"| {r['engine_s']:.2f} | {r['cost_per_1k']:.4f} |" for r in rows]
    return "\n".join(lines) + "\n"


def write_context_curve(folders: list[Path], out: Path, kind: str = "squad") -> str:
    rows = context_rows(folders, kind)
    picked = chosen(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONTEXT_FILE).write_text(json.dumps({"kind": kind, "rule": "one standard error", "chosen": picked,
                                                "rows": rows}, indent=2) + "\n")
    text = markdown(rows, picked, kind)
    (out / "context.md").write_text(text)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in picked:
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["budget"] for r in mine], [r["quality"] for r in mine], "o-", label=mode)
    ax.set_xscale("log", base=2)
    save_plot(fig, ax, out / "context.png", "context budget (prompt tokens)", f"{kind} F1", "Quality by context budget")
    return text


def read_chosen(path: Path) -> dict[str, int]:
    """The chosen budget per engine model from a context.json (or the folder holding one)."""
    path = path / CONTEXT_FILE if path.is_dir() else path
    try:
        return {m: int(b) for m, b in json.loads(path.read_text())["chosen"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunError(f"{path}: not a context curve (python -m evals context RUN... --out DIR): {e}") from None
