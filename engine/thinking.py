"""Thinking budgets: a per-request cap on the tokens inside the model's thinking span.

The prompt opens the span (or, for a budget of 0, opens and closes it). While the model
thinks, each step checks for the closing marker; when the budget is spent first, the engine
cuts the span at exactly the budget and forces the nudge and the closing marker (budget
forcing), so the answer follows. Forced tokens are appended to the sequence and computed as
a prefill chunk on the next step, like any other known tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ThinkingConfig
from engine.tokenizer import Tokenizer


@dataclass
class ThinkingState:
    budget: int
    start: int                  # index in token_ids of the first thinking token
    end: int | None = None      # index of the first answer token; None while thinking
    forced: bool = False

    def num_tokens(self, length: int) -> int:
        """Thinking tokens so far (a sequence of `length` tokens); forced ones do not count."""
        if self.end is None:
            return length - self.start
        return self.budget if self.forced else self.end - self.start


def open_span(prompt_ids: list[int], budget: int, cfg: ThinkingConfig, tok: Tokenizer) -> tuple[list[int], ThinkingState]:
    if budget == 0:
        ids = prompt_ids + tok.encode(f"{cfg.open}\n\n{cfg.close}\n\n")
        return ids, ThinkingState(0, len(ids), end=len(ids))
    ids = prompt_ids + tok.encode(f"{cfg.open}\n")
    return ids, ThinkingState(budget, len(ids))


def advance(token_ids: list[int], state: ThinkingState, cfg: ThinkingConfig, tok: Tokenizer) -> tuple[int, list[int]]:
    """After a step that added tokens while thinking: returns (keep, forced), the length to cut
    the sequence to and the tokens to append (both no-ops when the model is still within its
    budget). Sets state.end when the span closes."""
    spent = len(token_ids) - state.start
    within = min(spent, state.budget)
    if cfg.close in tok.decode(token_ids[state.start:state.start + within]):
        # The first prefix holding the marker ends the span (speculation may add several tokens).
        for n in range(1, within + 1):
            if cfg.close in tok.decode(token_ids[state.start:state.start + n]):
                state.end = state.start + n
                return len(token_ids), []
    if spent < state.budget:
        return len(token_ids), []
    keep = state.start + state.budget
    forced = tok.encode(f"{cfg.nudge}{cfg.close}\n\n")
    state.end, state.forced = keep + len(forced), True
    return keep, forced
