"""A step's two records, as vLLM v1 splits it: what the scheduler decided (`SchedulerOutput`:
the sequences that run, from which position, how many tokens, the drafts they verify) and what
the model runner produced for it (`RunnerOutput`, one entry per scheduled item, in order). The
runner reads only the first (and the sequences' block tables and sampling parameters); the
scheduler's postprocess reads both and is the one writer of a sequence's tokens and computed
count."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sequence import Sequence


@dataclass
class Draft:
    """Proposed next tokens for one sequence, and the distributions the draft model sampled
    them from (None: a deterministic proposal, as prompt lookup's and an external draft's)."""
    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int                 # position of its first token this step (what the cache holds before it)
    num_tokens: int            # tokens to compute, drafts included
    samples: bool              # the chunk reaches the sequence's end, so the step yields its next token
    draft: list[int] = field(default_factory=list)     # verified past the sequence's end, never in its tokens
    draft_probs: torch.Tensor | None = None
    shift: int = 0             # tokens its window dropped just before this step (its sinks are rewritten)
    # Async scheduling: its one token is the one the step before it samples, not yet in token_ids.
    placeholder: bool = False

    @property
    def num_draft(self) -> int:
        return len(self.draft)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.samples

    def tokens(self, start: int, end: int) -> list[int]:
        """The sequence's token_ids[start:end], continued by this step's draft past the end."""
        ids = self.seq.token_ids
        n = len(ids)
        return ids[start:end] + self.draft[max(start - n, 0):max(end - n, 0)]


@dataclass
class SchedulerOutput:
    items: list[ScheduledSeq] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class RunnerOutput:
    """Per scheduled item, in order: its new tokens (one, or for a verification the accepted
    drafts plus one; none for a prompt chunk short of its end or a failure), their
    log-probabilities under the model's own distribution, with `probs` asked for the
    distribution a sampled token came from, and why its share of the step failed."""
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    errors: list[str | None]
    probs: list[torch.Tensor | None]

    @classmethod
    def empty(cls, n: int) -> RunnerOutput:
        return cls([[] for _ in range(n)], [[] for _ in range(n)], [None] * n, [None] * n)
