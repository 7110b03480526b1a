"""The numbers of a run (summary.json), from its per-question log: quality, tokens, cost,
engine time, latency and escalation per mode, and how the small and large models compare
on the questions both answered."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import msgspec
import numpy as np

from evals.metrics import same_answer
from evals.records import Record, RecordLog
from evals.router_metrics import (
    CurvePoint,
    apgr,
    cascade_sweep,
    cost_at_quality,
    oracle_cascade,
    oracle_scores,
    threshold_sweep,
)
from evals.runner import MODES, RunConfig
from router.features import feature_vector
from router.policy import Policy, goes_large

TOKEN_KINDS = ("prompt", "cached", "output", "thinking")
TARGET = 0.95     # "cost at 95% of large-only quality"
COST_TARGET = 0.65    # the product's promise: TARGET of large-only quality at this share of its dollars


def ordered_modes(modes: set[str]) -> list[str]:
    return [m for m in MODES if m in modes] + sorted(modes - set(MODES))


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    p50, p95 = np.percentile(values, [50, 95])
    return {"p50": round(float(p50), 4), "p95": round(float(p95), 4)}


def mode_summary(records: list[Record]) -> dict:
    n = len(records)
    by_kind = {}
    for kind in sorted({r.kind for r in records}):
        rs = [r for r in records if r.kind == kind]
        entry = {"questions": len(rs), "em": _mean(r.em for r in rs)}
        if kind != "gsm8k":
            entry["f1"] = _mean(r.f1 for r in rs)
        by_kind[kind] = entry | {"quality": _mean(r.score for r in rs),
                                 "cost_per_1k_questions": 1000 * sum(r.cost for r in rs) / len(rs),
                                 "engine_s_per_question": _mean(r.engine_s for r in rs),
                                 "thinking_per_question": _mean(r.tokens("thinking") for r in rs),
                                 # How they were answered: the models called in turn ("small,large":
                                 # escalated; "large,large": widened), and how many thought.
                                 "calls": dict(Counter(",".join(c.model for c in r.calls) for r in rs)),
                                 "with_thinking": sum(r.tokens("thinking") > 0 for r in rs)}
    cost = sum(r.cost for r in records)
    engine = sum(r.engine_s for r in records)
    answered = {}
    for r in records:
        if r.answered_by:
            answered[r.answered_by] = answered.get(r.answered_by, 0) + 1
    return {
        "questions": n,
        "errors": sum(r.error is not None for r in records),
        "quality": _mean(r.score for r in records),
        "accuracy": _mean(float(r.correct) for r in records),
        "by_kind": by_kind,
        "cost": {"total": cost, "per_question": cost / n, "per_1k_questions": 1000 * cost / n},
        "tokens": {k: sum(r.tokens(k) for r in records) for k in TOKEN_KINDS},
        "tokens_per_question": {k: round(sum(r.tokens(k) for r in records) / n, 2) for k in TOKEN_KINDS},
        "engine_s": {"total": round(engine, 3), "per_question": round(engine / n, 4)},
        "ttft_s": percentiles([r.ttft for r in records if r.ttft is not None]),
        "latency_s": percentiles([r.latency for r in records if r.latency is not None]),
        "escalation_rate": _mean(float(r.escalated) for r in records),
        "answered_by": answered,
    }


def paired(log: RecordLog, a: str = "small", b: str = "large") -> tuple[list[Record], list[Record]]:
    """Records of two modes on the questions both answered, in the same order."""
    other = {r.id: r for r in log.of_mode(b)}
    first = [r for r in log.of_mode(a) if r.id in other]
    return first, [other[r.id] for r in first]


def router_curves(small: list[Record], large: list[Record]) -> dict[str, list[CurvePoint]]:
    """Quality-cost curves of routing between the two: at random (the straight line between
    them), by an oracle that knows which questions the large model answers better, and by a
    cascade escalating as that oracle would (it still pays every small call)."""
    qs, ql = [r.score for r in small], [r.score for r in large]
    cs, cl = [r.cost for r in small], [r.cost for r in large]
    return {"random": threshold_sweep(np.zeros(len(qs)), qs, ql, cs, cl),
            "oracle": threshold_sweep(oracle_scores(qs, ql), qs, ql, cs, cl),
            "oracle cascade": oracle_cascade(qs, ql, cs, cl)}


@dataclass
class TrainedRouter:
    """A trained router's view of a run, computed once: the small and large records of the
    questions it was not trained on, and its scores of each (the classifier's probabilities
    need the question embedded, which is the slow part)."""
    small: list[Record]
    large: list[Record]
    left_out: int                   # questions of the run that were in its training labels
    large_need: np.ndarray          # the routing score: arms' P(large right) - P(small right), else the
                                    # classifier's P(large worth it)
    first_large: np.ndarray         # the route: large beyond the default arm margin, else router.policy.goes_large
    confidence: np.ndarray          # the small answer's calibrated confidence
    by: str = "classifier"          # what routes first: the difficulty classifier, or the arms

    def curves(self, cost: str = "cost") -> dict[str, list[CurvePoint]]:
        """Quality-cost curves swept over the router's thresholds: the classifier alone, the
        cascade alone, and routed+cascade (the classifier's route, then the cascade on what it
        sent to the small model). `cost` is "cost" (dollars) or "engine_s"."""
        qs, ql = [r.score for r in self.small], [r.score for r in self.large]
        cs, cl = [getattr(r, cost) for r in self.small], [getattr(r, cost) for r in self.large]
        return {f"router: {self.by}": threshold_sweep(self.large_need, qs, ql, cs, cl),
                "router: cascade": cascade_sweep(np.zeros(len(qs), bool), self.confidence, qs, ql, cs, cl),
                "router: routed+cascade": cascade_sweep(self.first_large, self.confidence, qs, ql, cs, cl)}


def difficulty_probabilities(router, embedder, records: list[Record]) -> list[dict[str, float]]:
    """The trained classifier's probabilities of each difficulty, per record's question (its
    embedding and the retrieval scores the run logged), as the gateway's router computes them."""
    vectors = embedder.encode([r.question for r in records])
    return [router.classifier.probabilities(r.question, v, r.retrieval_scores) for r, v in zip(records, vectors)]


def trained_router(log: RecordLog, router, embedder, hard_thinking: int = 0) -> TrainedRouter | None:
    """A trained router (router.model.RouterModel) on the run's small and large answers to the
    questions it never saw in training; None when the run has no such pairs. `hard_thinking`:
    the thinking budget of hard questions, which decides whether they are worth the large model."""
    every, large = paired(log)
    keep = [i for i, r in enumerate(every) if r.id not in router.trained_on]
    if not keep:
        return None
    small, large = [every[i] for i in keep], [large[i] for i in keep]
    confidence = np.array([router.confidence([x for c in r.calls for x in c.logprobs]).value for r in small])
    if router.arms is not None:       # between the run's two arms: large when it beats small by the margin
        vectors = embedder.encode([r.question for r in small])
        p = router.arms.predict_rows(np.stack([feature_vector(r.question, v, r.retrieval_scores,
                                                              router.arms.with_embedding)
                                               for r, v in zip(small, vectors)]))
        need = np.nan_to_num(p["large"] - p["small"])     # a kind of question the arms never saw: no gain
        return TrainedRouter(small, large, len(every) - len(keep), need, need > Policy.arm_margin, confidence, "arms")
    probs = difficulty_probabilities(router, embedder, small)
    return TrainedRouter(small, large, len(every) - len(keep),
                         np.array([sum(v for d, v in p.items() if goes_large(d, hard_thinking)) for p in probs]),
                         np.array([goes_large(max(p, key=p.get), hard_thinking) for p in probs]), confidence)


def _cheapest_at(curve: list[CurvePoint], target: float) -> CurvePoint | None:
    """The cheapest point of the curve at or above `target` quality: a threshold to set."""
    ok = [p for p in curve if p.quality >= target]
    return min(ok, key=lambda p: p.cost) if ok else None


def router_summary(t: TrainedRouter) -> dict:
    """Per trained-router curve: APGR, and the cheapest threshold reaching 95% of large-only
    quality with its share of large-only cost, in dollars and in engine seconds."""
    n = len(t.small)
    q_small, q_large = _mean(r.score for r in t.small), _mean(r.score for r in t.large)
    totals = {"cost": sum(r.cost for r in t.large), "engine_s": sum(r.engine_s for r in t.large)}
    curves = {unit: t.curves(unit) for unit in totals}
    out = {}
    for name, curve in curves["cost"].items():
        best = _cheapest_at(curve, TARGET * q_large)
        twin = None if best is None else next(p for p in curves["engine_s"][name] if p.threshold == best.threshold)
        out[name] = {
            # APGR averages over the span of large-model shares the curve covers: a router that
            # sends almost everything to the large model covers a sliver, and its APGR says little.
            "large_share_range": [_round(min(p.large_share for p in curve)), _round(max(p.large_share for p in curve))],
            "apgr": _round(apgr(curve, q_small, q_large)),
            "cost_at_95_per_1k_questions": _scaled(cost_at_quality(curve, TARGET * q_large), 1000 / n),
            "threshold_at_95": None if best is None else _round(best.threshold),
            "at_95": None if best is None else {
                "quality": _round(best.quality), "large_share": _round(best.large_share),
                "cost_vs_large": _round(best.cost / totals["cost"]),
                "engine_s_vs_large": _round(twin.cost / totals["engine_s"])},
        }
    return {"questions": n, "left_out_as_trained_on": t.left_out, "curves": out}


def pair_summary(small: list[Record], large: list[Record]) -> dict | None:
    if not small:
        return None
    n = len(small)
    both = [(s.correct, l.correct) for s, l in zip(small, large)]
    q_small, q_large = _mean(r.score for r in small), _mean(r.score for r in large)
    bounds = {}
    for name, curve in router_curves(small, large).items():
        bounds[name] = {"apgr": _round(apgr(curve, q_small, q_large)),
                        "cost_at_95_per_1k_questions": _scaled(cost_at_quality(curve, TARGET * q_large), 1000 / n)}
    return {
        "questions": n,
        "quality": {"small": q_small, "large": q_large},
        "cost_per_1k_questions": {"small": 1000 * sum(r.cost for r in small) / n,
                                  "large": 1000 * sum(r.cost for r in large) / n},
        "agreement": _mean(float(same_answer(s.kind, s.answer, l.answer)) for s, l in zip(small, large)
                           if s.error is None and l.error is None),
        "correct": {"both": both.count((True, True)), "small_only": both.count((True, False)),
                    "large_only": both.count((False, True)), "neither": both.count((False, False))},
        "router_bounds": bounds,
    }


def ratio(x: float, of: float) -> float | None:
    """x as a share of `of`; None where `of` is 0 (no share of nothing)."""
    return x / of if of else None


def against_large(modes: dict[str, dict]) -> dict:
    """Each other mode's quality, dollars, engine seconds and thinking tokens per kind of
    question as shares of the large mode's on that kind, and whether it keeps TARGET of the
    quality at COST_TARGET of the dollars or less. The modes answered the same questions
    (RecordLog.keep_common)."""
    large, out = modes["large"]["by_kind"], {}
    for mode, s in modes.items():
        if mode == "large":
            continue
        for kind, k in s["by_kind"].items():
            share = {key: ratio(k[key], large[kind][key]) for key in
                     ("quality", "cost_per_1k_questions", "engine_s_per_question", "thinking_per_question")}
            share["target_met"] = (share["quality"] is not None and share["cost_per_1k_questions"] is not None
                                   and share["quality"] >= TARGET and share["cost_per_1k_questions"] <= COST_TARGET)
            out.setdefault(mode, {})[kind] = share
    return out


def summarize(config: RunConfig, log: RecordLog, trained: TrainedRouter | None = None, left_out: int = 0) -> dict:
    """With `trained` (trained_router), also the trained router's curves on this run;
    `left_out`: questions the log had answered by some modes only (RecordLog.keep_common)."""
    modes = ordered_modes(log.modes())
    out = {"run": msgspec.to_builtins(config), "left_out": left_out,
           "modes": {m: mode_summary(log.of_mode(m)) for m in modes}}
    if "large" in modes:
        out["vs_large"] = against_large(out["modes"])
    if {"small", "large"} <= set(modes):
        out["small_vs_large"] = pair_summary(*paired(log))
    if trained is not None:
        out["trained_router"] = router_summary(trained)
    return out


def _mean(values) -> float | None:
    values = list(values)
    return round(float(np.mean(values)), 4) if values else None


def _scaled(x: float | None, factor: float) -> float | None:
    return None if x is None else x * factor


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
