"""Per-question labels the router trains on (labels.jsonl in the run folder): did the small
model answer correctly, did the large one, what each spent, and confidence features from
the small model's token log-probabilities.

The features are quantiles as well as the mean, which a long answer drags down even when
every token is sure; they cover every output token (thinking too, when a budget was on).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import numpy as np

from evals.records import Record, RecordLog
from evals.runner import RECORDS_FILE

LABELS_FILE = "labels.jsonl"


@dataclass(frozen=True)
class Confidence:
    mean: float
    min: float
    p10: float
    p25: float
    p50: float
    length: int


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


def confidence(logprobs: list[float]) -> Confidence | None:
    if not logprobs:
        return None
    lp = np.asarray(logprobs, float)
    p10, p25, p50 = np.percentile(lp, [10, 25, 50])
    return Confidence(round(float(lp.mean()), 4), round(float(lp.min()), 4), round(float(p10), 4),
                      round(float(p25), 4), round(float(p50), 4), len(lp))


def _tokens(r: Record) -> Tokens:
    return Tokens(r.tokens("prompt"), r.tokens("cached"), r.tokens("output"), r.tokens("thinking"))


def labels(log: RecordLog) -> list[Label]:
    """One label per question the small mode answered, with the large mode's outcome where it ran."""
    large = {r.id: r for r in log.of_mode("large")}
    out = []
    for s in log.of_mode("small"):
        lp = [x for c in s.calls for x in c.logprobs]
        item = Label(s.id, s.kind, s.question, s.correct, s.score, _tokens(s), confidence(lp), s.retrieval_scores)
        if s.id in large:
            big = large[s.id]
            item = replace(item, large_correct=big.correct, large_score=big.score, large_tokens=_tokens(big))
        out.append(item)
    return out


def write_labels(folder: Path) -> int:
    """(Re)write labels.jsonl from the run folder's log; returns how many labels it holds."""
    rows = labels(RecordLog(folder / RECORDS_FILE))
    encoder = msgspec.json.Encoder()
    (folder / LABELS_FILE).write_bytes(b"".join(encoder.encode(r) + b"\n" for r in rows))
    return len(rows)
