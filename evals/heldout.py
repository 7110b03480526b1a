"""A trained router's arms on labelled questions it was not trained on (heldout.json): the
labels of a test-split run (generated, or from the proxy at a training run's thresholds)
say which arms answer each question right, so the router's picks are scored without
generating again.

- APGR between the small and large arms, sweeping the score P(large right) - P(small right),
  beside the oracle's (the labels' own gain) and random routing's 0.5;
- per arm margin (a tenant's `arm_margin`), the arms' policy (router.policy.route_arms) as
  served, without widening: its quality (and against large-only's on the questions it could
  be scored on), its expected dollars and the share of each arm, against every single arm;
- the cascade (`cascade_report`), where small answers were generated, and the same for each
  narrow arm that widens (`large@256`, asked again with the whole context when unsure),
  where its answers were generated.

Dollars are expected, not spent: per arm, the mean prompt and output tokens of the router's
training labels at the run's prices (a proxy label generates nothing to count).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from msgspec.structs import astuple

from evals.router_metrics import (apgr, cascade_sweep, cost_at_quality, oracle_cascade, oracle_scores,
                                  threshold_sweep)
from evals.runner import PAIR, RunError, read_config
from pipeline import cost
from router.data import read_labels
from router.features import feature_vector
from router.policy import Policy, route_arms

MARGINS = (0.0, 0.02, 0.05, 0.1, 0.2)
TARGET = 0.95
HELDOUT_FILE = "heldout.json"


def heldout_report(folder: Path, router, embedder) -> dict:
    if router.arms is None:
        raise RunError("this router has no arms (train it on labels that cover two arms or more)")
    prices = read_config(folder).prices
    arms = router.arms
    every = read_labels(folder)
    labels = [l for l in every if l.id not in router.trained_on
              and all(a.name in l.arms for a in arms.arms if a.name in PAIR)]
    if len(labels) < 2:
        raise RunError(f"{folder}: {len(labels)} labelled questions the router was not trained on; need 2")
    vectors = embedder.encode([l.question for l in labels])
    rows = np.stack([feature_vector(l.question, v, l.retrieval_scores, arms.with_embedding)
                     for l, v in zip(labels, vectors)])
    predicted = arms.predict_rows(rows)
    price = {a.name: cost(prices[a.model], round(arms.tokens[a.name][0]), 0, round(arms.tokens[a.name][1]))
             for a in arms.arms}
    right = {a.name: np.array([l.arms[a.name].correct if a.name in l.arms else np.nan for l in labels], float)
             for a in arms.arms}
    n = len(labels)
    qs, ql = right["small"], right["large"]
    cs, cl = np.full(n, price["small"]), np.full(n, price["large"])
    curves = {"router": threshold_sweep(predicted["large"] - predicted["small"], qs, ql, cs, cl),
              "oracle": threshold_sweep(oracle_scores(qs, ql), qs, ql, cs, cl),
              "oracle cascade": oracle_cascade(qs, ql, cs, cl)}
    two = {name: {"apgr": _r(apgr(c, qs.mean(), ql.mean())),
                  "cost_at_95_vs_large": _r(_share(cost_at_quality(c, TARGET * ql.mean()), cl.sum()))}
           for name, c in curves.items()}
    single = {a: {"quality": _r(float(np.nanmean(right[a]))), "labelled": int(np.sum(~np.isnan(right[a]))),
                  "cost_vs_large": _r(price[a] / price["large"])} for a in right}
    policies = {}
    for margin in MARGINS:
        policy = Policy("small", PAIR, {"easy": 0, "medium": 0, "hard": 1024}, 0.5, arm_margin=margin)
        picks = [route_arms(policy, arms.arms, *PAIR, lambda i=i: {a: float(p[i]) for a, p in predicted.items()},
                            lambda arm: price[arm.name]).arm for i in range(n)]
        scored = np.array([right[a][i] for i, a in enumerate(picks)])
        known = ~np.isnan(scored)
        # Large-only on the same questions: an arm labelled on part of them (the proxy stopped
        # early) leaves its picks elsewhere unscored, and the rest may be easier or harder.
        policies[str(margin)] = {"quality": _r(float(scored[known].mean())), "scored": int(known.sum()),
                                 "quality_vs_large": _r(float(scored[known].mean() / ql[known].mean()))
                                 if ql[known].mean() else None,
                                 "cost_vs_large": _r(sum(price[a] for a in picks) / (n * price["large"])),
                                 "arms": {a: picks.count(a) for a in dict.fromkeys(picks)}}
    trained = [l for l in every if l.id in router.trained_on]
    return {"questions": n, "left_out_as_trained_on": len(trained),
            "sources": {s: sum(l.source == s for l in labels) for s in sorted({l.source for l in labels})},
            "expected_cost_per_question": {a: _r(c, 9) for a, c in price.items()},
            "small_vs_large": two, "arms": single, "policies": policies,
            "cascade": cascade_report(router.confidence, trained, labels, price),
            "widen": {name: cascade_report(model, trained, labels, price, name) for name, model in router.narrow.items()
                      if name in price}}


def cascade_report(confidence, trained: list, held: list, price: dict[str, float], first: str = "small") -> dict | None:
    """The cascade on its own (every question to the `first` arm, escalated to the large arm
    when the confidence model's P(right) of its answer is under the threshold), on the
    held-out questions whose first answer was generated: the threshold is the cheapest
    reaching TARGET of large-only quality on the training labels, then applied as is to the
    held-out ones. The first call is counted whole (an early verdict would cut some short).
    Only questions where both answers were generated count: a proxy verdict set against a
    generated one mixes two measures (they disagree on about one question in six). None
    without such questions on both sides."""
    def features(l):         # labels written before arms kept their confidence have the small one's only
        return l.arms[first].confidence or (l.confidence if first == "small" else None)

    def arrays(labels):
        labels = [l for l in labels if first in l.arms and features(l) is not None
                  and "large" in l.arms and l.arms["large"].output is not None]
        conf = np.array([confidence.of_quantiles(astuple(features(l))).value for l in labels])
        qs, ql = (np.array([l.arms[a].correct for l in labels], float) for a in (first, "large"))
        return conf, qs, ql, np.full(len(labels), price[first]), np.full(len(labels), price["large"])

    train, test = arrays(trained), arrays(held)
    if len(train[0]) < 2 or len(test[0]) < 2:
        return None
    fit = [p for p in cascade_sweep(np.zeros(len(train[0]), bool), *train) if p.quality >= TARGET * train[2].mean()]
    t = min(fit, key=lambda p: p.cost).threshold
    conf, qs, ql, cs, cl = test
    escalate = conf < t
    quality, spent = float(np.where(escalate, ql, qs).mean()), float(np.where(escalate, cs + cl, cs).sum())
    oracle = cost_at_quality(oracle_cascade(qs, ql, cs, cl), TARGET * ql.mean())
    return {"threshold": _r(t), "trained_on": len(train[0]), "questions": len(conf),
            "escalated": _r(float(escalate.mean())), "quality": _r(quality), "large_quality": _r(float(ql.mean())),
            "quality_vs_large": _r(quality / ql.mean()) if ql.mean() else None,
            "cost_vs_large": _r(spent / cl.sum()), "oracle_cascade_cost_at_95_vs_large": _r(_share(oracle, cl.sum()))}


def write_heldout(folder: Path, router, embedder) -> dict:
    report = heldout_report(folder, router, embedder)
    (folder / HELDOUT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _share(x: float | None, total: float) -> float | None:
    return None if x is None else x / total


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)
