"""What the order of a widened context costs and buys. Two record logs of the same routed
questions (mode routed+cascade), one widened in canonical order (`[router] widen_from_cache =
false`) and one led by the narrow call's passages (true): on the SQuAD questions widened in
both (first call large, escalated), the widened call's prompt and cached tokens, both calls'
dollars, F1 against large-only's, and how many answers are the same. Then the SQuAD part of
the canonical run as it is, and with those questions answered as the other run did: the
shares of large-only quality and dollars either way. Writes benchmarks/results/widen_order.json.

    python benchmarks/widen_order.py .cache/evals/report-mixed-test/records.jsonl \
        .cache/evals/report-records-lead-first.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import RESULTS
from rich.console import Console
from rich.table import Table

from evals.records import Record, RecordLog

MODE = "routed+cascade"


def widened(r: Record) -> bool:
    return r.kind == "squad" and r.escalated and r.calls[0].model == "large"


def measure(canonical_path: Path, lead_path: Path) -> dict:
    logs = [RecordLog(p) for p in (canonical_path, lead_path)]
    canonical, lead = ({i: r for (m, i), r in log.records.items() if m == MODE} for log in logs)
    large = {i: r for (m, i), r in logs[0].records.items() if m == "large"}
    for log in logs:
        log.close()
    squad = sorted(i for i, r in canonical.items() if r.kind == "squad" and i in large)
    both = [i for i in squad if i in lead and widened(canonical[i]) and widened(lead[i])]
    rows = [{"id": i, "wide_prompt": [canonical[i].calls[1].prompt_tokens, lead[i].calls[1].prompt_tokens],
             "wide_cached": [canonical[i].calls[1].cached_tokens, lead[i].calls[1].cached_tokens],
             "cost": [canonical[i].cost, lead[i].cost], "f1": [canonical[i].score, lead[i].score],
             "large_only_f1": large[i].score, "same_answer": canonical[i].answer == lead[i].answer} for i in both]
    mean = lambda key, k: float(np.mean([r[key][k] for r in rows]))
    swapped = {i: lead[i] if i in both else canonical[i] for i in squad}
    share = lambda answers: {"quality": float(np.mean([answers[i].score for i in squad])
                                              / np.mean([large[i].score for i in squad])),
                             "cost": float(sum(answers[i].cost for i in squad) / sum(large[i].cost for i in squad))}
    return {"canonical": str(canonical_path), "lead": str(lead_path), "widened_in_both": len(rows),
            "widened": {"prompt_tokens": [mean("wide_prompt", 0), mean("wide_prompt", 1)],
                        "cached_tokens": [mean("wide_cached", 0), mean("wide_cached", 1)],
                        "cost_per_1k": [1e3 * mean("cost", 0), 1e3 * mean("cost", 1)],
                        "f1": [mean("f1", 0), mean("f1", 1)],
                        "large_only_f1": float(np.mean([r["large_only_f1"] for r in rows])),
                        "same_answer": sum(r["same_answer"] for r in rows)},
            "squad": {"questions": len(squad), "canonical": share(canonical), "lead": share(swapped)},
            "questions": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("canonical", type=Path, help="records.jsonl widened in canonical order")
    ap.add_argument("lead", type=Path, help="records.jsonl of the same questions widened from the cache")
    ap.add_argument("--out", type=Path, default=RESULTS / "widen_order.json")
    args = ap.parse_args()
    result = measure(args.canonical, args.lead)
    w, s = result["widened"], result["squad"]
    table = Table(title=f"{result['widened_in_both']} SQuAD questions widened in both runs "
                        f"({w['same_answer']} answers the same)")
    for col in ("wider context", "prompt", "cached", "$ / 1k", "F1", "SQuAD: quality / $ of large-only"):
        table.add_column(col, justify="left" if col == "wider context" else "right")
    for k, name in enumerate(("canonical order", "narrow passages first")):
        part = s["canonical" if k == 0 else "lead"]
        table.add_row(name, f"{w['prompt_tokens'][k]:.0f}", f"{w['cached_tokens'][k]:.0f}",
                      f"{w['cost_per_1k'][k]:.4f}", f"{w['f1'][k]:.3f}", f"{part['quality']:.1%} / {part['cost']:.1%}")
    Console().print(table)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
