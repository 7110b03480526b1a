"""Answer metrics: SQuAD's exact match and F1 (normalized as in its official evaluation
script), GSM8K's exact match of the final number, and how evals score one answer by kind."""
from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD v1.1's evaluate script)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: list[str]) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def f1(prediction: str, answers: list[str]) -> float:
    def one(pred: str, gold: str) -> float:
        p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
        common = sum((Counter(p) & Counter(g)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(p), common / len(g)
        return 2 * precision * recall / (precision + recall)
    return max(one(prediction, a) for a in answers)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The answer's number: after '####' when present (GSM8K's own format), else the last one."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    found = _NUMBER.findall(tail)
    if not found:
        return None
    value = found[0] if "####" in text else found[-1]
    value = value.replace(",", "")
    return value.rstrip("0").rstrip(".") if "." in value else value


def gsm8k_match(prediction: str, reference: str) -> float:
    got = final_number(prediction)
    return float(got is not None and got == final_number(reference))


# The service's prompt asks for citations like [1]; they are the answer's format, not its
# content, and would otherwise cost extractive answers their exact match.
_CITATION = re.compile(r"\[\d+\]")
# A question counts as answered correctly (for router labels and agreement tables) from here.
CORRECT_AT = 0.5


def strip_citations(text: str) -> str:
    return _CITATION.sub(" ", text)


@dataclass(frozen=True)
class Score:
    em: float
    f1: float | None        # None where it is not defined: a GSM8K number matches or not

    @property
    def value(self) -> float:
        """The one quality number of an answer: F1 where defined, else exact match."""
        return self.em if self.f1 is None else self.f1

    @property
    def correct(self) -> bool:
        return self.value >= CORRECT_AT


def score(kind: str, prediction: str, answers: list[str]) -> Score:
    """`kind` "gsm8k": the final number against the reference solution's; anything else
    (SQuAD, users' question sets): EM and F1 against the gold answers, citations removed."""
    if kind == "gsm8k":
        return Score(gsm8k_match(prediction, answers[0]), None)
    text = strip_citations(prediction)
    return Score(exact_match(text, answers), f1(text, answers))


def same_answer(kind: str, a: str, b: str) -> bool:
    """Whether two models gave the same answer: the same final number for GSM8K, the same
    normalized text (citations removed) otherwise."""
    if kind == "gsm8k":
        x = final_number(a)
        return x is not None and x == final_number(b)
    return normalize_answer(strip_citations(a)) == normalize_answer(strip_citations(b))
