"""A request as the engine sees it: its tokens, where their KV lives, how to sample."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from engine.sampling_params import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()
log = logging.getLogger("sluice.engine")


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    params: SamplingParams
    salt: bytes = b""               # prefix-cache namespace (per tenant)
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0    # tokens whose KV is in the cache
    num_cached_tokens: int = 0      # of those, how many came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0      # leading full blocks already registered in the prefix cache
    status: Status = Status.WAITING
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None        # why its step failed; the engine then finishes it alone
    output_text: str = ""
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    waited_steps: int = 0           # steps spent waiting behind others (aging)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    # Speculative decoding: this step's proposed tokens (appended to token_ids only while the
    # target verifies them), the draft model's distributions for sampled requests, and the
    # per-sequence speculation state (None: this sequence does not speculate).
    draft: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    spec: Any = None
    thinking: Any = None            # ThinkingState when the request has a thinking budget

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if not self.request_id:
            self.request_id = str(self.seq_id)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def answer_start(self) -> int | None:
        """Index of the first answer token: after the thinking span, None while still in it."""
        return self.num_prompt_tokens if self.thinking is None else self.thinking.end

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than the newest token still lacks KV: the next step runs a prefill chunk."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size


@contextmanager
def isolated(seq: Sequence) -> Iterator[None]:
    """One sequence's share of a batched step: an exception in it fails that sequence alone
    (the engine finishes it with its error) and the batch goes on."""
    try:
        yield
    except Exception as exc:
        log.warning("request %s failed", seq.request_id, exc_info=True)
        seq.error = seq.error or f"{type(exc).__name__}: {exc}"
