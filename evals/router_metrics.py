"""How good a router is, from per-question scores of both models.

A router gives each question a score and sends it to the large model when the score is at
least a threshold. Sweeping the threshold from "nobody" to "everybody" draws a curve of
quality against cost (and against the share of calls to the large model). Two numbers sum
the curve up:

- APGR, average performance gap recovered (RouteLLM, Ong et al. 2024): the performance gap
  recovered at large-model share x is PGR(x) = (quality(x) - small) / (large - small); APGR
  is its mean over x in [0, 1], the area under the curve by the trapezoidal rule. Routing
  at random recovers 0.5; a perfect router more.
- cost at 95%: the least cost at which the curve reaches 95% of the large model's quality.

Until the router exists, evals draw these curves for an oracle router (it knows which
questions the large model answers better: the upper bound a router can reach) next to the
straight line of random routing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CurvePoint:
    threshold: float
    large_share: float      # of questions sent to the large model, in [0, 1]
    quality: float          # mean score over all questions
    cost: float             # dollars, all questions together


def threshold_sweep(scores, small_quality, large_quality, small_cost, large_cost,
                    thresholds=None) -> list[CurvePoint]:
    """One point per threshold; question i goes to the large model when scores[i] >= t.
    Without `thresholds`: every distinct score, plus +inf (all to the small model), so the
    curve runs from share 0 to share 1."""
    s = np.asarray(scores, float)
    qs, ql = np.asarray(small_quality, float), np.asarray(large_quality, float)
    cs, cl = np.asarray(small_cost, float), np.asarray(large_cost, float)
    if not len(s) == len(qs) == len(ql) == len(cs) == len(cl) > 0:
        raise ValueError("scores, qualities and costs need one value per question, and at least one question")
    ts = sorted(set(s.tolist()) | {float("inf")}) if thresholds is None else sorted(thresholds)
    points = []
    for t in ts:
        large = s >= t
        points.append(CurvePoint(float(t), float(large.mean()), float(np.where(large, ql, qs).mean()),
                                 float(np.where(large, cl, cs).sum())))
    return points


def cascade_sweep(first_large, confidence, small_quality, large_quality, small_cost, large_cost) -> list[CurvePoint]:
    """The cascade at every escalation threshold (a tenant's escalation_threshold: escalate
    when confidence < threshold). Questions with `first_large` go to the large model at once (a
    classifier's route); the others are answered by the small model and escalated below the
    threshold, paying for both calls. Greedy answers are deterministic, so an escalated
    question gets exactly the large mode's answer: this is what a cascaded run would score at
    each threshold. The curve runs from no escalation to escalating every small answer."""
    first = np.asarray(first_large, bool)
    conf = np.asarray(confidence, float)
    qs, ql = np.asarray(small_quality, float), np.asarray(large_quality, float)
    cs, cl = np.asarray(small_cost, float), np.asarray(large_cost, float)
    points = []
    for t in sorted(set(conf[~first].tolist()) | {float(np.nextafter(1.0, 2.0))}):
        escalate = ~first & (conf < t)
        large = first | escalate
        points.append(CurvePoint(t, float(large.mean()), float(np.where(large, ql, qs).mean()),
                                 float(np.where(first, cl, np.where(escalate, cs + cl, cs)).sum())))
    return points


def oracle_scores(small_quality, large_quality) -> np.ndarray:
    """What a router that knew the answers would score: the large model's gain."""
    return np.asarray(large_quality, float) - np.asarray(small_quality, float)


def oracle_cascade(small_quality, large_quality, small_cost, large_cost) -> list[CurvePoint]:
    """The cascade's ceiling: every question pays the small call, and the escalations go to
    the questions where the large model gains most, as if the confidence knew the answers."""
    n = len(small_quality)
    return cascade_sweep(np.zeros(n, bool), -oracle_scores(small_quality, large_quality),
                         small_quality, large_quality, small_cost, large_cost)


def apgr(curve: list[CurvePoint], small: float, large: float) -> float | None:
    """Area under PGR(large share), divided by the span of shares the curve covers (1 for a
    full sweep), as RouteLLM computes it. None when the two models score the same."""
    if large == small or len(curve) < 2:
        return None
    pts = sorted(curve, key=lambda p: (p.large_share, p.quality))
    x = np.array([p.large_share for p in pts])
    pgr = (np.array([p.quality for p in pts]) - small) / (large - small)
    span = x[-1] - x[0]
    return float(np.sum((x[1:] - x[:-1]) * (pgr[1:] + pgr[:-1]) / 2) / span) if span > 0 else None


def cost_at_quality(curve: list[CurvePoint], target: float) -> float | None:
    """The least cost at which the curve reaches `target` quality, walking it by cost and
    interpolating linearly between its points (sending a random part of the questions the
    next point's way reaches any cost between two points). None if it never does."""
    pts = sorted(curve, key=lambda p: (p.cost, -p.quality))
    for prev, p in zip([None, *pts], pts):
        if p.quality >= target:          # and prev, if any, is below it
            if prev is None:
                return p.cost
            return prev.cost + (target - prev.quality) / (p.quality - prev.quality) * (p.cost - prev.cost)
    return None
