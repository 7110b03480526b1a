"""Per-request sampling parameters, validated where they enter the engine."""
from __future__ import annotations

import math

import msgspec

# What the sampler guarantees, for API schemas to state: every finite temperature >= 0 and
# top_p in (0, 1] samples without error. A temperature below MIN_TEMPERATURE decodes
# greedily (dividing float32 logits by less can overflow them); however small top_p is, the
# most likely token stays in the distribution. Seeds are torch's range.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 0.0         # exclusive
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1


class ThinkingExit(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Thinking that ends once its answer has settled (engine/early_exit.py): every `every`
    thinking tokens the engine closes the span in a fork and reads the answer it would give
    now; once `agree` probes in a row give the same answer, the last with confidence (the 25th
    percentile of its token probabilities, the cascade's default rule) of at least `confidence`,
    the span is closed where that probe forked and its answer is the request's.
    `observe`: probe and record, never exit (what the router lab fits thresholds on)."""
    every: int = 64
    first: int = 0                      # thinking tokens before the first probe (0: every)
    confidence: float = 0.9
    agree: int = 2
    answer_tokens: int = 32             # a probe reads the answer to its end within this many tokens
    observe: bool = False

    def errors(self) -> list[tuple[str, str]]:
        """(key, what it must be) for each bad setting."""
        return [(key, message) for bad, key, message in (
            (self.every < 1, "every", f"must be >= 1 (thinking tokens between probes), got {self.every}"),
            (self.first < 0, "first", f"must be >= 0 (thinking tokens before the first probe), got {self.first}"),
            (not 0 < self.confidence < 1, "confidence", f"must be in (0, 1), got {self.confidence}"),
            (self.agree < 1, "agree", f"must be >= 1 (probes in a row that agree), got {self.agree}"),
            (self.answer_tokens < 1, "answer_tokens", f"must be >= 1, got {self.answer_tokens}")) if bad]


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    temperature: float = 0.0            # below MIN_TEMPERATURE (0 included): greedy
    top_k: int = 0                      # 0 means off
    top_p: float = 1.0
    seed: int | None = None             # same seed, same output
    max_tokens: int = 256
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Tokens the model may spend inside its thinking span; 0: no thinking (a native thinker
    # gets its span closed in the prompt). max_tokens counts the answer after the span.
    max_thinking_tokens: int = 0
    include_thinking: bool = False      # return the thinking text in `text` too
    thinking_exit: ThinkingExit | None = None   # early exit; None: the span runs to its marker or its budget

    def __post_init__(self) -> None:
        errors = [message for bad, message in (
            (not (self.temperature >= 0 and math.isfinite(self.temperature)),
             f"temperature must be a finite number >= 0, got {self.temperature}"),
            (self.top_k < 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (not MIN_TOP_P < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED,
             f"seed must be in [-2**63, 2**64 - 1], got {self.seed}"),
            (self.max_tokens < 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.max_thinking_tokens < 0,
             f"max_thinking_tokens must be >= 0, got {self.max_thinking_tokens}"),
            (any(not s for s in self.stop), "stop strings must not be empty")) if bad]
        if self.thinking_exit is not None:
            errors += [f"thinking_exit.{key} {message}" for key, message in self.thinking_exit.errors()]
        if errors:
            raise ValueError("bad sampling parameters: " + "; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
