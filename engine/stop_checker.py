"""Every rule that ends a request's turn, in one place: after each step (`check`), eos and
the request's stop tokens, max_tokens (which counts the answer, not the thinking), the
model's context, and inside a thinking span the span's rules; on the answer's text
(`check_text`), stop strings; while the model writes (`bans`), what it may not write yet.

Thinking spans: when the budget is spent before the closing marker, the span is cut at
exactly the budget and the nudge and the marker are forced (budget forcing). A model that
does not think natively often ends its turn inside the span or right after it, its whole
solution written as thinking: an empty answer. So a stop token inside the span closes it in
its place (no nudge: the model was done), and the stop tokens are banned until the answer
holds a word (a letter or a digit). Such a model, its answer already written inside the span,
then fills the answer with line breaks (or a code fence) up to max_tokens: after BLANK_TOKENS
of them, every token that writes no letter or digit is banned too, and the model writes its
answer out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import ModelConfig, ThinkingConfig
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, ThinkingState
from engine.step import ScheduledSeq
from engine.tokenizer import Tokenizer

# The closing marker plus a little whitespace fits in this many tokens: a step decodes no
# more of the span than the new tokens and these before them.
MARKER_TOKENS = 16
# The wordless tokens an answer may open with (a line break, a sign) before a word must follow.
BLANK_TOKENS = 2


@dataclass
class Verdict:
    """Cut the sequence to `keep` tokens, then append `forced` or finish with `reason`."""
    keep: int
    forced: list[int] = field(default_factory=list)
    reason: str | None = None


class StopChecker:
    def __init__(self, cfg: ModelConfig, tok: Tokenizer, thinking: ThinkingConfig, max_model_len: int):
        self.eos_ids = frozenset(cfg.eos_token_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
        self.tok, self.thinking, self.max_model_len = tok, thinking, max_model_len
        self.wordless_ids = tok.wordless_ids()      # once per model (half a second for 150k tokens)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a request's turn: resolved once, when it is added."""
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)

    def open_span(self, prompt_ids: list[int], budget: int) -> tuple[list[int], ThinkingState]:
        """The prompt with a thinking span opened (for a budget of 0, opened and closed)."""
        cfg = self.thinking
        ids = prompt_ids + self.tok.encode(f"{cfg.open}\n\n{cfg.close}\n\n" if budget == 0 else f"{cfg.open}\n")
        return ids, ThinkingState(budget, len(ids), end=len(ids) if budget == 0 else None)

    def check(self, seq: Sequence, first: int) -> Verdict | None:
        """After a step appended token_ids[first:] (several with speculation): the first
        rule that fires among them decides."""
        th = seq.thinking
        if th is not None and th.end is None and len(seq) < self.max_model_len:
            verdict = self._in_span(seq, th, first)
            if verdict is not None or th.end is None:
                return verdict
            first = max(first, th.end)
        ids, stops, answer = seq.token_ids, seq.stop_ids, seq.num_prompt_tokens if th is None else th.end
        if answer is None:      # the span is still open at the end of the context
            return Verdict(max(first + 1, self.max_model_len), reason="length")
        limit = min(answer + seq.params.max_tokens, self.max_model_len)
        for length in range(first + 1, len(ids) + 1):
            if ids[length - 1] in stops:
                return Verdict(length, reason="stop")
            if length >= limit:
                return Verdict(length, reason="length")
        return None

    def _in_span(self, seq: Sequence, th: ThinkingState, first: int) -> Verdict | None:
        """Whatever comes first: the closing marker (the span ends after it; the answer's
        rules take the tokens after it), a stop token (the span is closed in its place), the
        budget (cut there, nudge and marker forced)."""
        ids, cfg = seq.token_ids, self.thinking
        budget_end = min(len(ids), th.start + th.budget)
        stop = next((i for i in range(first, budget_end) if ids[i] in seq.stop_ids), budget_end)
        lo = max(th.start, first - MARKER_TOKENS)
        if cfg.close in self.tok.decode(ids[lo:stop]):
            th.end = next(n for n in range(lo + 1, stop + 1) if cfg.close in self.tok.decode(ids[lo:n]))
            return None
        if stop < budget_end:
            return self._force(th, stop, f"{cfg.close}\n\n")
        if len(ids) < th.start + th.budget:
            return None
        return self._force(th, th.start + th.budget, cfg.forced)

    def _force(self, th: ThinkingState, keep: int, text: str) -> Verdict:
        forced = self.tok.encode(text)
        th.end, th.num_forced = keep + len(forced), len(forced)
        return Verdict(keep, forced)

    def close_early(self, th: ThinkingState, keep: int) -> Verdict:
        """Close the span after `keep` tokens, as a probe that forked there did (early exit)."""
        th.exited = True
        return self._force(th, keep, self.thinking.early_close)

    def bans(self, item: ScheduledSeq, i: int) -> list[int]:
        """The tokens the model may not write at index i of a scheduled sequence (of its
        token_ids, its draft after them): the stop tokens while a closed thinking span is
        followed by no word (no letter or digit; markers aside), and past BLANK_TOKENS of those,
        every wordless token too. The span may close inside a draft being verified, before
        `th.end` is known."""
        seq = item.seq
        th = seq.thinking
        if th is None or i <= th.start or not seq.stop_ids:
            return []
        if th.end is not None and th.end <= i:
            if th.answered_at is not None and i >= th.answered_at:
                return []           # text stays text: no need to decode the growing answer again
            if self._blank(self.tok.decode(item.tokens(th.end, i))):
                return list(seq.stop_ids) + (self.wordless_ids if i - th.end >= BLANK_TOKENS else [])
            if i <= len(seq):       # remembered for committed tokens only, never on a draft's word
                th.answered_at = i
            return []
        text = self.tok.decode(item.tokens(max(th.start, i - MARKER_TOKENS), i))
        at = text.rfind(self.thinking.close)
        return list(seq.stop_ids) if at >= 0 and self._blank(text[at + len(self.thinking.close):]) else []

    def _blank(self, answer: str) -> bool:
        """No letter or digit, markers aside (small models like to close the span twice)."""
        return not any(c.isalnum() for c in answer.replace(self.thinking.open, "").replace(self.thinking.close, ""))

    @staticmethod
    def check_text(seq: Sequence, new: str) -> tuple[str, bool]:
        """Stop strings, on the text a step decoded: what to emit, and whether one ended the
        answer (before it). One may straddle steps, so a tail that could begin one is held back
        until the next step or the finish; only that tail and the new text are searched."""
        stops = seq.params.stop
        if not stops:           # nothing to search for, nothing held back
            return new, False
        text = seq.held_text + new
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
        keep = len(text) if seq.is_finished else max(len(text) - max((len(s) - 1 for s in stops), default=0), 0)
        seq.held_text = text[keep:]
        return text[:keep], False
