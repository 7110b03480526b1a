"""Per-request sampling parameters, validated where they enter the engine."""
from __future__ import annotations

import msgspec


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
        if not self.temperature >= 0:
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            errors.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
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
        return self.temperature == 0
