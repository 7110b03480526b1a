"""Continuous batching for one model: which sequences run this step, and how many tokens.

Every step takes decodes first (one token each), then prefill chunks up to the step's token
budget (chunked prefill), so a long prompt never stalls the streams already running. When
blocks run out, the most recently admitted sequence is preempted and later recomputed
(its prefix blocks usually still sit in the prefix cache, so recompute is cheap).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int            # tokens to compute this step, from seq.num_computed_tokens
    num_draft: int = 0         # of those, speculative tokens the step verifies

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.samples

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so the step yields its next token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_model_len: int, max_num_batched_tokens: int,
                 max_num_seqs: int, max_wait_steps: int, eos_token_ids: tuple[int, ...]):
        self.bm = block_manager
        # A sequence never outgrows the model's context nor the whole KV pool, so a lone
        # sequence can always make progress.
        self.max_model_len = min(max_model_len, len(block_manager.blocks) * block_manager.block_size)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_wait_steps = max_wait_steps
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if not seq.token_ids:
            raise ValueError("prompt is empty")
        if len(seq) >= self.max_model_len:
            raise ValueError(f"prompt has {len(seq)} tokens; this model accepts at most "
                             f"{self.max_model_len - 1} (context {self.max_model_len} including output)")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        chunks: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            if seq.in_prefill:
                n = min(len(seq) - seq.num_computed_tokens, budget)
                chunks.append(ScheduledSeq(seq, n))
                budget -= n
                continue
            while not self.bm.can_append(seq):
                victim = self.running[-1]
                for item in decodes:
                    if item.seq is victim and item.num_draft:       # its draft was already appended
                        del victim.token_ids[-item.num_draft:]
                self._preempt(victim)
                decodes = [s for s in decodes if s.seq is not victim]
                chunks = [s for s in chunks if s.seq is not victim]
                if victim is seq:
                    break
            else:
                self.bm.append_slot(seq)
                k = min(len(seq.draft), budget - 1)
                if k and self.bm.resize(seq, len(seq) + k):
                    seq.token_ids.extend(seq.draft[:k])       # verified this step, rolled back after
                    decodes.append(ScheduledSeq(seq, 1 + k, num_draft=k))
                else:
                    decodes.append(ScheduledSeq(seq, 1))
                budget -= decodes[-1].num_tokens
        budget = self.max_num_batched_tokens - sum(s.num_tokens for s in decodes + chunks)
        self._admit(budget, chunks)
        return decodes + chunks

    def _admit(self, budget: int, chunks: list[ScheduledSeq]) -> None:
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self.bm.can_allocate(seq):
                seq.waited_steps += 1
                # Aging: once a request has been overtaken long enough, later ones wait
                # behind it so the blocks it needs can free up.
                if seq.waited_steps >= self.max_wait_steps:
                    break
                continue
            self.waiting.remove(seq)
            self.bm.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            chunks.append(ScheduledSeq(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.draft, seq.draft_probs = [], None
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, scheduled: list[ScheduledSeq], new_tokens: dict[int, list[int]]) -> None:
        """Advance computed counts, roll back rejected drafts, append the new tokens (accepted
        drafts, then the step's own token), and finish on eos, stop tokens or length, dropping
        whatever came after the finish."""
        for item in scheduled:
            seq = item.seq
            tokens = new_tokens.get(seq.seq_id) or []
            if item.num_draft:
                del seq.token_ids[len(seq) - item.num_draft:]
                seq.draft, seq.draft_probs = [], None
                seq.num_computed_tokens += 1         # the last real token; accepted drafts next
            else:
                seq.num_computed_tokens += item.num_tokens
            seq.token_ids.extend(tokens[:-1])        # accepted drafts: their KV is computed
            seq.num_computed_tokens += len(tokens[:-1])
            self.bm.register_computed(seq)
            if not tokens:
                continue
            base = len(seq) - (len(tokens) - 1)      # length before the first new token
            seq.token_ids.append(tokens[-1])
            if item.num_draft:
                self.bm.resize(seq, len(seq))        # return the rejected drafts' surplus blocks
            for i, token in enumerate(tokens):
                reason = self._finish_reason(seq, token, base + i + 1)
                if reason:
                    del seq.token_ids[base + i + 1:]
                    self.finish(seq, reason)
                    break

    def stop_ids(self, seq: Sequence) -> set[int]:
        """The tokens that end this request's turn."""
        return set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)

    def _finish_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        answer_start = seq.answer_start          # max_tokens counts the answer, not the thinking
        # Inside a thinking span a stop token closes the span (thinking.advance), not the turn.
        if answer_start is not None and token in self.stop_ids(seq):
            return "stop"
        if answer_start is not None and length - answer_start >= seq.params.max_tokens:
            return "length"
        return "length" if length >= self.max_model_len else None

    def replace_tail(self, seq: Sequence, length: int, tokens: list[int]) -> None:
        """Cut a running sequence back to `length` tokens and append `tokens` (budget forcing);
        they are computed as a chunk on the next step. A block the cut falls inside is given
        back and its kept tokens recomputed in a fresh one: it may be cached and shared, so it
        must never be written again."""
        full = length // self.bm.block_size
        del seq.token_ids[length:]
        seq.token_ids.extend(tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, full * self.bm.block_size)
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, full)
        self.bm.resize(seq, full * self.bm.block_size)
        if not self.bm.resize(seq, len(seq)):
            self._preempt(seq)      # no room now: it comes back with all its tokens as a prompt

    def finish(self, seq: Sequence, reason: str) -> list[int]:
        """Finish (or abort) a sequence wherever it is, returning its blocks at once. A failed
        one ("error") also takes its blocks out of the prefix cache: returns those, to be zeroed."""
        forgotten: list[int] = []
        if seq.status is Status.FINISHED:
            return forgotten
        if seq in self.running:
            self.running.remove(seq)
            forgotten = self.bm.free_seq(seq, forget=reason == "error")
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        return forgotten
