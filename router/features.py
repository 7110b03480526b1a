"""Difficulty features of one question: its text, its embedding and its retrieval scores.

Training (from labels.jsonl) and serving (in the gateway) build the vector with the same
function, so a model only ever sees features computed the way it was trained on. Any change
to what goes in the vector, or to what a saved router holds, bumps FEATURE_VERSION, which
saved routers are checked against.
"""
from __future__ import annotations

import math
import re

import numpy as np

FEATURE_VERSION = 3                  # 3: arms price and offer themselves per kind of question
QUESTION_WORDS = ("what", "who", "when", "where", "which", "why", "how")
NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
MATH = re.compile(r"[+\-*/=%^]")


def text_features(question: str) -> list[float]:
    """Cheap signals of effort: long, numeric, arithmetic or why/how questions tend to be harder."""
    words = question.lower().split()
    first = next((w for w in words if w.strip("\"'(") in QUESTION_WORDS), "")
    numbers = NUMBER.findall(question)
    return [math.log1p(len(question)), math.log1p(len(words)), math.log1p(len(numbers)),
            sum(c.isdigit() for c in question) / max(1, len(question)), math.log1p(len(MATH.findall(question))),
            float("?" in question), *(float(first.strip("\"'(") == w) for w in QUESTION_WORDS)]


def retrieval_features(scores: list[float]) -> list[float]:
    """A clear winner (high top score, wide gap to the second) suggests the answer is in one
    passage; flat, low scores suggest it is not there or must be assembled. All zero, with the
    flag off, when nothing was searched."""
    if not scores:
        return [0.0] * 6
    s = sorted(scores, reverse=True)
    second = s[1] if len(s) > 1 else s[0]
    return [1.0, s[0], s[0] - second, s[0] - s[-1], float(np.mean(s)), math.log1p(len(s))]


# The column of retrieval_features' flag (something was searched) in a feature vector.
RETRIEVED = len(text_features(""))


def feature_vector(question: str, embedding: np.ndarray, scores: list[float],
                   with_embedding: bool = True) -> np.ndarray:
    """One row: text features, retrieval features, then (with_embedding) the unit-length
    question embedding. Training decides whether the embedding earns its place: a few hundred
    labels cannot fit its hundreds of dimensions without overfitting."""
    head = np.asarray(text_features(question) + retrieval_features(scores), np.float32)
    return np.concatenate([head, np.asarray(embedding, np.float32).ravel()]) if with_embedding else head
