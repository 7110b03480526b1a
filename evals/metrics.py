"""Answer metrics: SQuAD's exact match and F1 (normalized as in its official evaluation
script) and GSM8K's exact match of the final number."""
from __future__ import annotations

import re
import string
from collections import Counter

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
