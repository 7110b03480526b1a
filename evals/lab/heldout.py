"""A trained router's arms on labelled questions it was not trained on (heldout.json): the
labels of a test-split run (generated, or from the proxy at a training run's thresholds)
say which arms answer each question right, so the router's picks are scored without
generating again.

- APGR between the small and large arms, sweeping the score P(large right) - P(small right),
  beside the oracle's (the labels' own gain) and random routing's 0.5;
- per arm margin (a tenant's `arm_margin`), the arms' policy (router.policy.route_arms) as
  served, without widening: its quality (and against large-only's on the questions it could
  be scored on), its expected dollars and the share of each arm, against every single arm;
- on closed-book questions, where the thinking arms are (`thinking_report`): each arm, the
  oracle and the policy per margin against the best arm's exact match, dollars and thinking
  tokens, with the thinking targets met or missed, as `eval budgets` states them on runs;
- the cascade (`cascade_report`), where small answers were generated, and the same for each
  narrow arm that widens (`large@256`, asked again with the whole context when unsure),
  where its answers were generated.

Dollars are expected, not spent: per arm, the mean prompt and output tokens of the router's
training labels on the question's kind (retrieved or closed-book, router.arms.retrieved) at the
run's prices (a proxy label generates nothing to count). An arm is scored only on the kinds of
question it was trained on, as it is offered only for those.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from msgspec.structs import astuple

from evals.budgets import against_best
from evals.router_metrics import apgr, cascade_sweep, cost_at_quality, oracle_cascade, oracle_scores, threshold_sweep
from evals.runner import PAIR, RunError, read_config
from pipeline import cost
from router.arms import KINDS, retrieved
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
    parse = {a.name: a for a in arms.arms}

    def price_of(name: str, kind: bool) -> float:
        """An arm's expected dollars on a question of this kind; NaN where it does not cover the kind."""
        t = arms.tokens[name].get(kind)
        return np.nan if t is None else cost(prices[parse[name].model], round(t[0]), 0, round(t[1]))
    every = read_labels(folder)
    labels = [l for l in every if l.id not in router.trained_on
              and all(a in l.arms and not np.isnan(price_of(a, retrieved(l.retrieval_scores))) for a in PAIR)]
    if len(labels) < 2:
        raise RunError(f"{folder}: {len(labels)} labelled questions the router was not trained on (of a kind "
                       f"its small and large arms cover); need 2")
    vectors = embedder.encode([l.question for l in labels])
    rows = np.stack([feature_vector(l.question, v, l.retrieval_scores, arms.with_embedding)
                     for l, v in zip(labels, vectors)])
    predicted = arms.predict_rows(rows)
    price = {a: np.array([price_of(a, retrieved(l.retrieval_scores)) for l in labels]) for a in parse}
    right = {a: np.array([l.arms[a].correct if a in l.arms and not np.isnan(price[a][i]) else np.nan
                          for i, l in enumerate(labels)], float) for a in parse}
    n = len(labels)
    qs, ql = right["small"], right["large"]
    cs, cl = price["small"], price["large"]
    curves = {"router": threshold_sweep(predicted["large"] - predicted["small"], qs, ql, cs, cl),
              "oracle": threshold_sweep(oracle_scores(qs, ql), qs, ql, cs, cl),
              "oracle cascade": oracle_cascade(qs, ql, cs, cl)}
    two = {name: {"apgr": _r(apgr(c, qs.mean(), ql.mean())),
                  "cost_at_95_vs_large": _r(_share(cost_at_quality(c, TARGET * ql.mean()), cl.sum()))}
           for name, c in curves.items()}
    # Each arm against large-only on the questions it covers.
    single = {a: {"quality": _r(float(np.nanmean(right[a]))), "labelled": int(np.sum(~np.isnan(right[a]))),
                  "cost_vs_large": _r(np.nansum(price[a]) / cl[~np.isnan(price[a])].sum())}
              for a in right if not np.isnan(right[a]).all()}
    policies, picked = {}, {}
    for margin in MARGINS:
        policy = Policy("small", PAIR, {"easy": 0, "medium": 0, "hard": 1024}, 0.5, arm_margin=margin)
        picks = [route_arms(policy, arms.arms, *PAIR,
                            lambda i=i: {a: float(p[i]) for a, p in predicted.items() if not np.isnan(p[i])},
                            lambda arm, i=i: price[arm.name][i]).arm for i in range(n)]
        picked[str(margin)] = picks
        scored = np.array([right[a][i] for i, a in enumerate(picks)])
        known = ~np.isnan(scored)
        # Large-only on the same questions: an arm labelled on part of them (the proxy stopped
        # early) leaves its picks elsewhere unscored, and the rest may be easier or harder.
        policies[str(margin)] = {"quality": _r(float(scored[known].mean())), "scored": int(known.sum()),
                                 "quality_vs_large": _r(float(scored[known].mean() / ql[known].mean()))
                                 if ql[known].mean() else None,
                                 "cost_vs_large": _r(sum(price[a][i] for i, a in enumerate(picks)) / cl.sum()),
                                 "arms": {a: picks.count(a) for a in dict.fromkeys(picks)}}
    trained = [l for l in every if l.id in router.trained_on]
    return {"questions": n, "left_out_as_trained_on": len(trained),
            "sources": {s: sum(l.source == s for l in labels) for s in sorted({l.source for l in labels})},
            "kinds": {KINDS[k]: sum(retrieved(l.retrieval_scores) == k for l in labels) for k in KINDS},
            "expected_cost_per_question": {a: {KINDS[k]: _r(price_of(a, k), 9) for k in KINDS
                                               if not np.isnan(price_of(a, k))} for a in parse},
            "small_vs_large": two, "arms": single, "policies": policies,
            "thinking": thinking_report(labels, picked, prices, parse, arms),
            "cascade": cascade_report(router.confidence, trained, labels, price_of),
            "widen": {name: cascade_report(model, trained, labels, price_of, name)
                      for name, model in router.narrow.items() if name in parse}}


def thinking_report(labels: list, picked: dict[str, list[str]], prices: dict, parse: dict, arms) -> dict | None:
    """The thinking targets on held-out labels, as `eval budgets` states them on runs: on the
    closed-book questions every closed-book arm answered (generated, so each arm's thinking
    tokens and dollars are what it spent, at list price), each arm, the oracle (the cheapest
    right arm) and the policy at each margin (`picked`: its arm per label) against the best
    arm. None without such questions (labels written before they kept thinking tokens)."""
    names = [a for a in parse if False in arms.tokens[a]]
    index = [i for i, l in enumerate(labels) if not retrieved(l.retrieval_scores)
             and all(a in l.arms and l.arms[a].thinking is not None for a in names)]
    if len(names) < 2 or not index:
        return None

    def spent(i: int, a: str) -> float:
        o = labels[i].arms[a]
        return cost(prices[parse[a].model], o.prompt, 0, o.output)

    def row(picks: list[str]) -> dict:
        """picks: the arm per question of `index`."""
        outcomes = [labels[i].arms[a] for i, a in zip(index, picks)]
        return {"em": _r(np.mean([o.correct for o in outcomes])),
                "thinking_tokens": _r(np.mean([o.thinking for o in outcomes]), 1),
                "cost_per_1k": _r(1000 * np.mean([spent(i, a) for i, a in zip(index, picks)]), 6),
                "arms": {a: picks.count(a) for a in dict.fromkeys(picks)}}
    single = {a: row([a] * len(index)) for a in names}
    best = max(single, key=lambda a: (single[a]["em"], -single[a]["cost_per_1k"]))
    oracle = row([min([a for a in names if labels[i].arms[a].correct] or names, key=lambda a: spent(i, a))
                  for i in index])
    policies = {m: row([picks[i] for i in index]) for m, picks in picked.items()}
    against_best([*single.values(), oracle, *policies.values()], single[best])
    return {"questions": len(index), "best": best, "arms": single, "oracle": oracle, "policies": policies}


def cascade_report(confidence, trained: list, held: list, price_of, first: str = "small") -> dict | None:
    """The cascade on its own (every question to the `first` arm, escalated to the large arm
    when the confidence model's P(right) of its answer is under the threshold), on the
    held-out questions whose first answer was generated: the threshold is the cheapest
    reaching TARGET of large-only quality on the training labels, then applied as is to the
    held-out ones. `price_of(arm, kind)`: its expected dollars on a question of that kind
    (router.arms.retrieved); NaN where the arm does not cover it. The first call is counted
    whole (an early verdict would cut some short).
    Only questions where both answers were generated count: a proxy verdict set against a
    generated one mixes two measures (they disagree on about one question in six). None
    without such questions on both sides."""
    def features(l):         # labels written before arms kept their confidence have the small one's only
        return l.arms[first].confidence or (l.confidence if first == "small" else None)

    def kind(l) -> bool:
        return retrieved(l.retrieval_scores)

    def arrays(labels):
        labels = [l for l in labels if first in l.arms and features(l) is not None
                  and "large" in l.arms and l.arms["large"].output is not None
                  and not np.isnan(price_of(first, kind(l)) + price_of("large", kind(l)))]
        conf = np.array([confidence.of_quantiles(astuple(features(l))).value for l in labels])
        qs, ql = (np.array([l.arms[a].correct for l in labels], float) for a in (first, "large"))
        cs, cl = (np.array([price_of(a, kind(l)) for l in labels]) for a in (first, "large"))
        return conf, qs, ql, cs, cl

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
