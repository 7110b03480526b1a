"""Would a cascade save thinking where the router cannot? On closed-book labels (GSM8K, the
thinking arms' `make router` run), start each problem at a cheaper arm (small, large without
thinking, large+think256) and pass it on to large+think1024 when that first answer's
calibrated confidence is under a threshold, as the small-to-large cascade does (the same
answer-log-probability features, router.confidence). Against large+think1024 alone, per
threshold: exact match, dollars (both calls priced whole, uncached, at the run's prices) and
thinking tokens, with P(right) cross-validated (5 folds) so no answer is judged by a model
that saw it. The oracle cascade passes on exactly the problems the first arm gets wrong.
Writes benchmarks/results/thinking_cascade.json.

    python benchmarks/thinking_cascade.py .cache/evals/train-gsm8k
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import RESULTS, ROOT
from rich.console import Console
from rich.table import Table
from sklearn.model_selection import StratifiedKFold

from evals.runner import read_config
from pipeline.prices import cost
from router.arms import parse_arm
from router.calibration import fit_calibrated
from router.confidence import features
from router.data import read_labels

BEST = "large+think1024"
FIRST = ("small", "large", "large+think256")
THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def cross_validated(x: np.ndarray, y: np.ndarray, seed: int = 0) -> np.ndarray:
    p = np.zeros(len(y))
    for fit, held in StratifiedKFold(5, shuffle=True, random_state=seed).split(x, y):
        model = fit_calibrated(x[fit], y[fit])
        p[held] = model.predict_proba(x[held])[:, list(model.classes_).index(True)]
    return p


def measure(run: Path) -> dict:
    prices = read_config(run).prices
    labels = [l for l in read_labels(run) if BEST in l.arms and all(a in l.arms for a in FIRST)]
    dollars = lambda name, o: cost(prices[parse_arm(name).model], o.prompt or 0, 0, o.output or 0)
    best = {"em": np.array([l.arms[BEST].correct for l in labels], float),
            "$": np.array([dollars(BEST, l.arms[BEST]) for l in labels]),
            "thinking": np.array([l.arms[BEST].thinking or 0 for l in labels], float)}
    share = lambda key, values: float(values.mean() / best[key].mean())
    out = {"run": str(run.resolve().relative_to(ROOT)), "problems": len(labels), "best": BEST,
           "best_alone": {"em": float(best["em"].mean()), "$ / 1k": 1e3 * float(best["$"].mean()),
                          "thinking": float(best["thinking"].mean())}, "first": {}}
    for name in FIRST:
        arm = [l.arms[name] for l in labels]
        right = np.array([o.correct for o in arm], bool)
        spent = np.array([dollars(name, o) for o in arm])
        thought = np.array([o.thinking or 0 for o in arm], float)
        p = cross_validated(np.array([features(o.confidence) for o in arm]), right)
        cascade = lambda on: {"passed_on": float(on.mean()), "em": share("em", np.where(on, best["em"], right)),
                              "$": share("$", spent + on * best["$"]),
                              "thinking": share("thinking", thought + on * best["thinking"])}
        out["first"][name] = {"alone": {"em": share("em", right.astype(float)), "$": share("$", spent),
                                        "thinking": share("thinking", thought)},
                              "brier": float(np.mean((p - right) ** 2)),
                              "brier_base_rate": float(np.mean((right.mean() - right) ** 2)),
                              "oracle": cascade(~right),
                              "thresholds": {str(t): cascade(p < t) for t in THRESHOLDS}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a run folder whose labels.jsonl has the thinking arms (make router's)")
    ap.add_argument("--out", type=Path, default=RESULTS / "thinking_cascade.json")
    args = ap.parse_args()
    result = measure(args.run)
    table = Table(title=f"Cascades to {BEST} on {result['problems']} problems, as shares of {BEST} alone")
    for col in ("first arm", "threshold", "passed on", "EM", "$", "thinking"):
        table.add_column(col, justify="left" if col == "first arm" else "right")
    for name, r in result["first"].items():
        rows = [("alone", None, r["alone"]), *((t, c["passed_on"], c) for t, c in r["thresholds"].items()),
                ("oracle", r["oracle"]["passed_on"], r["oracle"])]
        for t, passed, c in rows:
            table.add_row(name, t, "" if passed is None else f"{passed:.0%}", f"{c['em']:.0%}", f"{c['$']:.0%}",
                          f"{c['thinking']:.0%}")
    Console().print(table)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
