"""Thinking budgets: a per-request cap on the tokens inside the model's thinking span.

The prompt opens the span (or, for a budget of 0, opens and closes it). While the model
thinks, each step checks for the closing marker; when the budget is spent first, the engine
cuts the span at exactly the budget and forces the nudge and the closing marker (budget
forcing), so the answer follows. Forced tokens are appended to the sequence and computed as
a prefill chunk on the next step, like any other known tokens.

A model that is not a native thinker often ends its turn inside the span, or right after
closing it, having written its whole solution as thinking: that would hand the user an empty
answer. So a stop token inside the span closes the span instead of ending the turn, and until
a non-blank answer token exists the stop tokens are banned (`answer_bans`).
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
    num_forced: int = 0         # tokens the engine appended to close the span
    answered_at: int | None = None   # a length at which the answer already held text

    def num_tokens(self, length: int) -> int:
        """Thinking tokens so far (a sequence of `length` tokens); forced ones do not count."""
        if self.end is None:
            return length - self.start
        return self.end - self.start - self.num_forced


@dataclass
class Step:
    """What the engine does to a sequence after a thinking step: cut it to `keep` tokens, then
    append `forced` (to close the span) or finish it (`stop`: the answer already ended)."""
    keep: int
    forced: list[int]
    stop: bool = False


def open_span(prompt_ids: list[int], budget: int, cfg: ThinkingConfig, tok: Tokenizer) -> tuple[list[int], ThinkingState]:
    if budget == 0:
        ids = prompt_ids + tok.encode(f"{cfg.open}\n\n{cfg.close}\n\n")
        return ids, ThinkingState(0, len(ids), end=len(ids))
    ids = prompt_ids + tok.encode(f"{cfg.open}\n")
    return ids, ThinkingState(budget, len(ids))


def advance(token_ids: list[int], state: ThinkingState, cfg: ThinkingConfig, tok: Tokenizer,
            stops: set[int]) -> Step:
    """After a step that added tokens while thinking (the scheduler does not finish a sequence
    on a stop token inside the span). Sets state.end when the span closes. A step may add
    several tokens (speculation), so whatever comes first decides:
    - the closing marker: the span ends after it; a stop token later in the step ends the answer;
    - a stop token: the model ended its turn while thinking, so its thinking is over; the
      engine closes the span in its place and the answer follows;
    - the budget: the span is cut at exactly the budget and the nudge and marker are forced."""
    n_tokens = len(token_ids)
    spent = n_tokens - state.start
    within = min(spent, state.budget)
    span = token_ids[state.start:state.start + within]
    first_stop = next((i for i, t in enumerate(span) if t in stops), len(span))
    if cfg.close in tok.decode(span[:first_stop]):
        n = next(n for n in range(1, first_stop + 1) if cfg.close in tok.decode(span[:n]))
        state.end = state.start + n
        after = next((i for i in range(state.end, n_tokens) if token_ids[i] in stops), None)
        return Step(n_tokens, []) if after is None else Step(after + 1, [], stop=True)
    if first_stop < len(span):
        return _force(state, state.start + first_stop, tok.encode(f"{cfg.close}\n\n"))
    if spent < state.budget:
        return Step(n_tokens, [])
    return _force(state, state.start + state.budget, tok.encode(f"{cfg.nudge}{cfg.close}\n\n"))


def _force(state: ThinkingState, keep: int, forced: list[int]) -> Step:
    state.end, state.num_forced = keep + len(forced), len(forced)
    return Step(keep, forced)


def answer_bans(token_ids: list[int], length: int, state: ThinkingState | None, stops: list[int],
                cfg: ThinkingConfig, tok: Tokenizer, committed: int | None = None) -> list[int]:
    """The tokens the model may not write at index `length`: `stops` when the span has closed
    before it and only whitespace or markers follow; none otherwise. Works on drafts too
    (the span may close inside a draft that is being verified, before `state.end` is known);
    `committed`: how many of token_ids are not drafts (all when None), the only ones whose
    verdict may be remembered."""
    if state is None or length <= state.start:
        return []
    if state.end is not None and state.end <= length:
        if state.answered_at is not None and length >= state.answered_at:
            return []           # text stays text: no need to decode the growing answer again
        if _blank(tok.decode(token_ids[state.end:length]), cfg):
            return stops
        if committed is None or length <= committed:
            state.answered_at = length
        return []
    # The marker plus a little whitespace fits in the last few tokens; no need to decode the span.
    text = tok.decode(token_ids[max(state.start, length - 16):length])
    at = text.rfind(cfg.close)
    return stops if at >= 0 and _blank(text[at + len(cfg.close):], cfg) else []


def _blank(answer: str, cfg: ThinkingConfig) -> bool:
    """Nothing but whitespace and markers (small models like to close the span twice)."""
    return not answer.replace(cfg.open, "").replace(cfg.close, "").strip()
