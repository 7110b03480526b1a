"""The labels the router learns from: labels.jsonl, as evals write it (evals/lab/labels.py).
Read here with only the fields the router uses, so the router does not import evals."""
from __future__ import annotations

from pathlib import Path

import msgspec

DIFFICULTIES = ("easy", "medium", "hard")


class RouterError(ValueError):
    """Bad input to the router (labels, a saved router): the message says what was wrong."""


class Confidence(msgspec.Struct):
    mean: float
    min: float
    p10: float
    p25: float
    p50: float
    length: int


class ArmOutcome(msgspec.Struct):
    """How one arm (router.arms) did on a question: generated, or from the proxy (no tokens)."""
    correct: bool
    score: float
    prompt: int | None = None
    output: int | None = None          # generated tokens, thinking included
    confidence: Confidence | None = None   # of the generated answer's log-probabilities; None: proxy or none
    thinking: int | None = None        # of `output`, inside the thinking span; None: proxy, or an older label


class Label(msgspec.Struct):
    id: str
    question: str
    small_correct: bool
    confidence: Confidence | None
    retrieval_scores: list[float]
    large_correct: bool | None = None
    early: dict[str, Confidence] = {}   # of the small answer's first k tokens, by k, where it had more
    arms: dict[str, ArmOutcome] = {}    # by arm name (router.arms): every arm the label's runs answered with
    source: str = "generated"           # "proxy": no answer generated; "mixed": the large outcome from the proxy

    @property
    def difficulty(self) -> str | None:
        """easy: the small model is right; medium: only the large one is; hard: neither.
        None when the small model was wrong and the large one never ran."""
        if self.small_correct:
            return "easy"
        if self.large_correct is None:
            return None
        return "medium" if self.large_correct else "hard"


def read_labels(path: str | Path) -> list[Label]:
    path = Path(path)
    if path.is_dir():
        path = path / "labels.jsonl"
    if not path.is_file():
        raise RouterError(f"{path}: no labels file (write it with `python -m evals labels RUN` first)")
    decoder = msgspec.json.Decoder(Label)
    rows = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                rows.append(decoder.decode(line))
            except msgspec.DecodeError as e:
                raise RouterError(f"{path}:{n}: not a label: {e}") from None
    if not rows:
        raise RouterError(f"{path}: no labels in it")
    return rows
