"""The run folder's per-question log: one JSON line per question and mode, appended as each
question finishes and flushed to disk, so a run killed at any moment resumes where it stopped.
A torn last line (killed mid-write) is cut off when the log is opened; that question is
simply answered again."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec


@dataclass
class Call:
    """One engine request made for a question (a cascade makes two)."""
    model: str
    prompt_tokens: int
    cached_tokens: int       # of the prompt tokens, served by the prefix cache
    output_tokens: int       # thinking included: what is billed
    thinking_tokens: int
    cost: float              # dollars, at the run's prices
    retrieval_s: float       # composing the context: search, trim, prompt
    ttft: float              # seconds from arrival at the engine to the first token
    latency: float           # seconds from arrival at the engine to the last token
    engine_s: float          # this request's share of the engine's step time
    finish_reason: str
    logprobs: list[float]    # of each output token, for confidence features
    # Early exit (engine/early_exit.py): what its probes cost (in output_tokens), each probe as
    # [thinking tokens when it forked, the answer it read, its confidence, whether that ended within
    # its cap, its tokens, whether the answer was taken as the call's], and whether thinking ended early.
    probe_tokens: int = 0
    probes: list[list] = field(default_factory=list)
    thinking_exited: bool = False


@dataclass
class Record:
    mode: str
    id: str
    kind: str
    question: str
    answer: str
    em: float
    f1: float | None
    score: float             # F1 where defined, else EM: the quality number
    correct: bool
    escalated: bool          # more than one call: the question went past its first model
    passages: int            # in the prompt, after trimming
    context_tokens: int      # counted against the context budget
    retrieval_scores: list[float]     # of every hit the search returned, by rank
    calls: list[Call] = field(default_factory=list)
    error: str | None = None          # why it could not be answered (scored 0)
    # The run folder whose answer this is, copied rather than generated (runner.reusable):
    # that run's budget was larger, and this answer never reached this run's.
    copied_from: str | None = None

    @property
    def answered_by(self) -> str | None:
        return self.calls[-1].model if self.calls else None

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.calls)

    def tokens(self, kind: str) -> int:
        """Sum over calls of "prompt", "cached", "output", "thinking" or "probe" tokens."""
        return sum(getattr(c, f"{kind}_tokens") for c in self.calls)

    @property
    def engine_s(self) -> float:
        return sum(c.engine_s for c in self.calls)

    @property
    def latency(self) -> float | None:
        """What the user waits for the whole answer: every call, one after another."""
        return sum(c.retrieval_s + c.latency for c in self.calls) if self.calls else None

    @property
    def ttft(self) -> float | None:
        """Until the first token of the answer given: earlier calls are waited out in full."""
        if not self.calls:
            return None
        *before, last = self.calls
        return sum(c.retrieval_s + c.latency for c in before) + last.retrieval_s + last.ttft


def complete_lines(path: Path, cut: bool = False) -> list[bytes]:
    """An append-only JSON-lines file's lines up to its last newline: a torn last line (killed
    mid-write) is not a row yet. `cut`: also cut it off the file, as whoever appends next must,
    or it would end up mid-file."""
    data = path.read_bytes() if path.exists() else b""
    whole = data[:data.rfind(b"\n") + 1]
    if cut and len(whole) < len(data):
        with path.open("r+b") as f:
            f.truncate(len(whole))
    return whole.splitlines()


def read_records(path: Path) -> list[Record]:
    """A log's records up to its last newline, only read: a run still writing it is left
    alone (RecordLog, which appends, cuts a torn line off; a reader must not)."""
    return [msgspec.json.decode(line, type=Record) for line in complete_lines(path)]


class RecordLog:
    """records.jsonl, keyed by (mode, question id)."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[tuple[str, str], Record] = {}
        for line in complete_lines(path, cut=True):
            r = msgspec.json.decode(line, type=Record)
            self.records[r.mode, r.id] = r
        self._file = None

    def done(self, mode: str, question_id: str) -> bool:
        return (mode, question_id) in self.records

    def append(self, record: Record) -> None:
        if self._file is None:
            self._file = self.path.open("ab")
        self._file.write(msgspec.json.encode(record) + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[record.mode, record.id] = record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def keep_common(self) -> int:
        """Drop the questions some mode did not answer (a mode stopped at --limit N covers
        fewer), so that the modes compare on the same ones; returns how many were dropped."""
        modes, ids = self.modes(), {i for _, i in self.records}
        common = {i for i in ids if all((m, i) in self.records for m in modes)}
        self.records = {key: r for key, r in self.records.items() if key[1] in common}
        return len(ids - common)

    def of_mode(self, mode: str) -> list[Record]:
        return [r for (m, _), r in self.records.items() if m == mode]

    def modes(self) -> set[str]:
        return {m for m, _ in self.records}
