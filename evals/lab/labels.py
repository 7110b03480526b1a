"""Per-question labels the router trains on (labels.jsonl in the run folder): did the small
model answer correctly, did the large one, what each spent, and confidence features from
the small model's token log-probabilities. Beside them, the same outcomes per arm
(router.arms: `small`, `large`, `large+think256`, `large@256`...), named by the model, the
run's thinking budget and, where it differs from the labelled run's, its context budget, so
runs at other budgets over the same questions add their arms.

The features are quantiles as well as the mean, which a long answer drags down even when
every token is sure; they cover every output token (thinking too, when a budget was on).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from evals.lab.proxy import ProxyScore, best_scores, read_scores
from evals.records import Record, RecordLog
from evals.runner import RECORDS_FILE, RunError, load_dataset, read_config
from router.arms import arm_name
from router.confidence import EARLY_TOKENS, quantiles
from router.data import ArmOutcome, Confidence

LABELS_FILE = "labels.jsonl"


@dataclass(frozen=True)
class Tokens:
    prompt: int
    cached: int
    output: int
    thinking: int


@dataclass(frozen=True)
class Label:
    id: str
    kind: str
    question: str
    small_correct: bool
    small_score: float
    small_tokens: Tokens
    confidence: Confidence | None     # None when the small model produced no tokens
    retrieval_scores: list[float]     # the search's hits, by rank; empty without retrieval
    large_correct: bool | None = None    # None: the large mode did not run on this question
    large_score: float | None = None
    large_tokens: Tokens | None = None
    early: dict[str, Confidence] = field(default_factory=dict)   # of the small answer's first k tokens, where it
                                                                 # had more
    source: str = "generated"         # "proxy": from the reference's log-probability, no answer generated;
                                      # "mixed": the small answer generated, the large outcome from the proxy
    arms: dict[str, ArmOutcome] = field(default_factory=dict)    # by arm name: how each arm did


def confidence(logprobs: list[float]) -> Confidence | None:
    # The router's own feature code: what it trains on is what it computes when serving.
    return Confidence(*quantiles(logprobs)) if logprobs else None


def _tokens(r: Record) -> Tokens:
    return Tokens(r.tokens("prompt"), r.tokens("cached"), r.tokens("output"), r.tokens("thinking"))


def _outcome(r: Record) -> ArmOutcome:
    return ArmOutcome(r.correct, r.score, r.tokens("prompt"), r.tokens("output"),
                      confidence([x for c in r.calls for x in c.logprobs]), r.tokens("thinking"))


def arm_outcomes(log: RecordLog, thinking: int, context: int | None = None) -> dict[str, dict[str, ArmOutcome]]:
    """Question id -> arm -> outcome, from a run's single-model modes at its thinking budget
    (and `context`: its context budget, where the arm carries its own)."""
    out: dict[str, dict[str, ArmOutcome]] = {}
    for mode in ("small", "large"):
        for r in log.of_mode(mode):
            out.setdefault(r.id, {})[arm_name(mode, thinking, context)] = _outcome(r)
    return out


def proxy_verdicts(scores: list[ProxyScore], examples: list,
                   thresholds: dict[str, float]) -> dict[str, dict[str, ArmOutcome]]:
    """Question id -> model -> the proxy's verdict at the model's threshold, with the prompt's
    tokens where the scores kept them."""
    prompts = {(s.id, s.model): s.prompt for s in scores if s.prompt}
    out: dict[str, dict[str, ArmOutcome]] = {}
    for (qid, model), best in best_scores(scores, examples).items():
        right = best >= thresholds[model]
        out.setdefault(qid, {})[model] = ArmOutcome(right, float(right), prompts.get((qid, model)))
    return out


def labels(log: RecordLog, thinking: int = 0) -> list[Label]:
    """One label per question the small mode answered, with the large mode's outcome where it ran."""
    large = {r.id: r for r in log.of_mode("large")}
    arms = arm_outcomes(log, thinking)
    out = []
    for s in log.of_mode("small"):
        lp = [x for c in s.calls for x in c.logprobs]
        early = {str(k): confidence(lp[:k]) for k in EARLY_TOKENS if len(lp) > k}
        item = Label(s.id, s.kind, s.question, s.correct, s.score, _tokens(s), confidence(lp), s.retrieval_scores,
                     early=early, arms=arms[s.id])
        if s.id in large:
            big = large[s.id]
            item = replace(item, large_correct=big.correct, large_score=big.score, large_tokens=_tokens(big))
        out.append(item)
    return out


def proxy_labels(folder: Path, thresholds: dict[str, float]) -> list[Label]:
    """Labels from the run's proxy scores (evals/lab/proxy.py) at these thresholds; no confidence
    features, since no answer was generated."""
    read = read_scores(folder)
    examples = load_dataset(read_config(folder)).examples
    hits = {s.id: s.retrieval_scores for s in read if s.mean_logprob is not None}
    questions = {e.id: e for e in examples}
    out = []
    for qid, by_model in proxy_verdicts(read, examples, thresholds).items():
        if set(by_model) >= {"small", "large"} and qid in questions:
            small, large, e = by_model["small"], by_model["large"], questions[qid]
            out.append(Label(qid, e.kind, e.question, small.correct, small.score, Tokens(0, 0, 0, 0), None, hits[qid],
                             large.correct, large.score, None, source="proxy", arms={"small": small, "large": large}))
    return out


def with_proxy_large(label: Label, proxied: Label | None) -> Label:
    """A generated small answer whose question the large model never answered takes the large
    outcome from the proxy: small answers are cheap to generate (they train the cascade's
    confidence model, which needs the small model's own tokens), large ones are not."""
    if label.large_correct is not None or proxied is None:
        return label
    return replace(label, large_correct=proxied.large_correct, large_score=proxied.large_score,
                   arms=label.arms | {"large": proxied.arms["large"]}, source="mixed")


def provenance(folders: list[Path]) -> dict:
    """What a router trained on these run folders' labels came from: each run's settings and
    labels by source, and each model's weights (the store's sha256 of its GGUF, where it is a
    store model), which must be the same in every run: a router's labels say how these
    weights did."""
    from models.store import DEFAULT_MODELS
    configs = [read_config(folder) for folder in folders]
    models = {json.dumps(c.models, sort_keys=True) for c in configs}
    if len(models) > 1:
        raise RunError(f"the runs answered with different models ({'; '.join(sorted(models))}): train a router on "
                       f"labels of one pair of models")
    runs = []
    for folder, config in zip(folders, configs):
        rows = [msgspec.json.decode(line) for line in (folder / LABELS_FILE).read_bytes().splitlines() if line.strip()]
        runs.append({"folder": str(folder), "by_source": dict(Counter(row.get("source", "generated") for row in rows)),
                     "run": msgspec.to_builtins(config) | {"files": [Path(f).name for f in config.files]}})
    return {"labels": runs, "weights": {m: {"source": s, "gguf_sha256": DEFAULT_MODELS[s].sha256
                                            if s in DEFAULT_MODELS else None}
                                        for m, s in configs[0].models.items()}}


def write_labels(folder: Path, thresholds: dict[str, float] | None = None, arm_runs: list[Path] = ()) -> int:
    """(Re)write labels.jsonl from the run folder's log, and with `thresholds` from its proxy
    scores where no answer was generated; `arm_runs`: run folders over the same questions at
    other thinking or context budgets, whose answers (and with `thresholds`, proxy scores where
    none was generated) add arms to the labels. Returns how many labels."""
    config = read_config(folder)
    rows = labels(RecordLog(folder / RECORDS_FILE), config.thinking_budget)
    if thresholds is not None:
        proxied = {l.id: l for l in proxy_labels(folder, thresholds)}
        generated = {r.id for r in rows}
        rows = [with_proxy_large(r, proxied.get(r.id)) for r in rows]
        rows += [l for qid, l in proxied.items() if qid not in generated]
    for other in arm_runs:
        theirs = read_config(other)
        context = theirs.context_budget if theirs.context_budget != config.context_budget else None
        more = arm_outcomes(RecordLog(other / RECORDS_FILE), theirs.thinking_budget, context)
        if thresholds is not None:
            for qid, by_model in proxy_verdicts(read_scores(other), load_dataset(theirs).examples, thresholds).items():
                for model, outcome in by_model.items():
                    more.setdefault(qid, {}).setdefault(arm_name(model, theirs.thinking_budget, context), outcome)
        rows = [replace(r, arms=r.arms | more.get(r.id, {})) for r in rows]
    encoder = msgspec.json.Encoder()
    (folder / LABELS_FILE).write_bytes(b"".join(encoder.encode(r) + b"\n" for r in rows))
    return len(rows)
