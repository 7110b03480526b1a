"""A request as the engine sees it: its tokens, where their KV lives, how to sample, and its
speculation, thinking and text state."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from types import TracebackType

import torch

from engine.detokenizer import Detokenizer
from engine.sampling_params import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


@dataclass(frozen=True)
class Probe:
    """One look at the answer while a request thinks (engine/early_exit.py)."""
    at: int                     # thinking tokens when it forked
    text: str                   # the answer it read
    confidence: float           # 25th percentile of its token probabilities
    complete: bool              # the answer ended (eos or a stop token) within the probe's tokens
    tokens: int                 # what it cost: the closing marker and the answer tokens
    taken: bool = False         # its answer became the request's (early exit), so its tokens are the answer's


@dataclass
class ThinkingState:
    """Where a request stands in its thinking span (the stop checker keeps it; early exit
    adds its probes)."""
    budget: int
    start: int                  # index in token_ids of the first thinking token
    end: int | None = None      # index of the first answer token; None while thinking
    num_forced: int = 0         # tokens the engine appended to close the span
    answered_at: int | None = None   # a length at which the answer already held text
    probe: Sequence | None = None    # the fork now reading the answer; the request waits for it
    probes: list[Probe] = field(default_factory=list)
    next_probe: int = 0         # thinking tokens at which the next probe forks
    exited: bool = False        # the span was closed early, its answer settled

    def num_tokens(self, length: int) -> int:
        """Thinking tokens so far (a sequence of `length` tokens); forced ones do not count."""
        return length - self.start if self.end is None else self.end - self.start - self.num_forced


@dataclass(frozen=True)
class KVWindow:
    """StreamingLLM's cache for one sequence: the blocks of the first `sinks` tokens (attention
    sinks) and the most recent tokens stay; whole blocks between them are dropped as it grows,
    so that a query sees at most `size` tokens, itself included. Attention sees the positions
    StreamingLLM gives (within the cache: the recent tokens right after the sinks); as RoPE
    depends only on the distance between query and key, the engine gets there by rotating the
    sinks' keys forward by what was dropped, from an untouched copy, instead of rotating every
    kept key back at every drop (see BlockManager.evict)."""
    sinks: int
    size: int

    def sink_tokens(self, block_size: int) -> int:
        """The sinks rounded up to whole blocks: what stays at the front of the cache."""
        return -(-self.sinks // block_size) * block_size

    def dropped(self, position: int, block_size: int) -> int:
        """Tokens evicted before the token at `position` is computed: the fewest whole blocks
        after the sinks that leave it at most `size` tokens to attend to. A function of the
        position alone, so a token sees the same keys however steps are cut (decode, verify)."""
        over = position + 1 - self.size
        return 0 if over <= 0 else -(-over // block_size) * block_size

    def last_position(self, position: int, block_size: int) -> int:
        """The last position that sees the same keys as `position` (a verified draft may not
        cross an eviction)."""
        return self.dropped(position, block_size) + self.size - 1

    def errors(self, block_size: int, max_model_len: int) -> list[tuple[str, str]]:
        """What is wrong with this window for a model: (key, what it must be) pairs."""
        least = max(self.sink_tokens(block_size), 0) + block_size
        return [(key, message) for bad, key, message in (
            (self.sinks < 0, "sinks", f"must be >= 0, got {self.sinks}"),
            (self.size < least, "window", f"must hold the sinks (rounded up to {block_size}-token blocks) plus "
                                          f"one block: at least {least} tokens, got {self.size}"),
            (self.size > max_model_len, "window", f"must be at most the model's context ({max_model_len} tokens), "
                                                  f"got {self.size}")) if bad]


@dataclass
class SpecState:
    """Speculation, per sequence: the external draft (a continuation of the prompt), and
    acceptance per draft source."""
    external: list[int] = field(default_factory=list)
    acceptance: dict[str, float] = field(default_factory=lambda: {"external": 0.9, "lookup": 0.5, "model": 0.7})
    source: str | None = None       # the source of the draft now being verified
    idle_steps: int = 0             # steps since speculation last ran, for re-probing


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
    window: KVWindow | None = None  # None: every token's KV stays
    num_dropped: int = 0            # tokens evicted from between the sinks and the window
    num_evicted: int = 0            # the most it dropped (a preempted sequence restarts at 0)
    sink_source: list[int] = field(default_factory=list)   # its original sink blocks, once it dropped
    status: Status = Status.WAITING
    stop_ids: frozenset[int] = frozenset()     # the tokens that end its turn (StopChecker.stop_ids)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None        # why its step failed; the engine then finishes it alone
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    waited_steps: int = 0           # steps spent waiting behind others (aging)
    engine_s: float = 0.0           # its share of the steps while it was in the engine
    generator: torch.Generator | None = None
    spec: SpecState | None = None               # speculation's state (None: no speculation)
    thinking: ThinkingState | None = None      # when the request has a thinking budget
    probe_of: Sequence | None = None            # a probe: the thinking request it reads ahead for
    # The answer's text, decoded as it grows; emitted in pieces but for a tail held back (it
    # may begin a stop string).
    detokenizer: Detokenizer | None = None
    text: list[str] = field(default_factory=list)
    held_text: str = ""

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        self.request_id = self.request_id or str(self.seq_id)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def answer_start(self) -> int | None:
        """Index of the first answer token: after the thinking span, None while still in it."""
        return self.num_prompt_tokens if self.thinking is None else self.thinking.end

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def waits_for_probe(self) -> bool:
        """Its thinking pauses while a probe reads its answer, so an exit lands where it forked."""
        return self.thinking is not None and self.thinking.probe is not None

    @property
    def in_prefill(self) -> bool:
        """More than the newest token still lacks KV: the next step runs a prefill chunk."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) - self.num_dropped + block_size - 1) // block_size


class isolated:
    """One sequence's share of a batched step: an exception in it fails that sequence alone
    (the engine finishes it with its error) and the batch goes on. A class, not a generator:
    every sequence enters one at every step, and a generator costs several times as much."""

    def __init__(self, seq: Sequence):
        self.seq = seq

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if not isinstance(exc, Exception):
            return False
        self.seq.error = self.seq.error or failure(self.seq, exc)
        return True


def failure(seq: Sequence, exc: Exception) -> str:
    """Log one sequence's failure; what its error says."""
    logging.getLogger("sluice.engine").warning("request %s failed", seq.request_id, exc_info=exc)
    return f"{type(exc).__name__}: {exc}"
