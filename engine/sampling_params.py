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


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    temperature: float = 0.0            # 0 means greedy
    top_k: int = 0                      # 0 means off
    top_p: float = 1.0
    seed: int | None = None             # same seed, same output
    max_tokens: int = 256
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Tokens the model may spend inside its thinking span (None: no span is opened; 0: the
    # span is closed in the prompt). max_tokens then counts the answer after the span.
    thinking_budget: int | None = None
    include_thinking: bool = False      # return the thinking text in `text` too

    def __post_init__(self) -> None:
        errors = []
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            errors.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            errors.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not MIN_TOP_P < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            errors.append(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if self.max_tokens < 1:
            errors.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            errors.append(f"thinking_budget must be >= 0, got {self.thinking_budget}")
        if any(not s for s in self.stop):
            errors.append("stop strings must not be empty")
        if errors:
            raise ValueError("bad sampling parameters: " + "; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
