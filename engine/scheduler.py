"""Continuous batching for one model: which sequences run this step, and how many tokens.

Every step takes decodes first (one token each), then prefill chunks up to the step's token
budget (chunked prefill), so a long prompt never stalls the streams already running. When
blocks run out, the most recently admitted sequence is preempted and later recomputed
(its prefix blocks usually still sit in the prefix cache, so recompute is cheap).

A sequence with a KV window (sequence.KVWindow) gets blocks chunk by chunk rather than for its
whole prompt, and before each of its steps drops what its window no longer shows the step's
first token (BlockManager.evict); a verified draft is cut where the window would move, so a
token sees the same keys with speculation as without.
"""
from __future__ import annotations

from collections import deque

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status, isolated
from engine.step import Draft, RunnerOutput, ScheduledSeq, SchedulerOutput
from engine.stop_checker import StopChecker

# What postprocess reports per sequence that has news: the sequence, its length before the
# step, and the log-probabilities of the tokens it gained.
Update = tuple[Sequence, int, list[float]]


class Scheduler:
    def __init__(self, block_manager: BlockManager, stop: StopChecker, max_num_batched_tokens: int,
                 max_num_seqs: int, max_wait_steps: int):
        self.bm, self.stop = block_manager, stop
        self.max_model_len = stop.max_model_len
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_wait_steps = max_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Each sequence's latest scheduled item whose output postprocess has not applied yet:
        # with async scheduling, the step still running while the next one is planned.
        self.in_flight: dict[int, ScheduledSeq] = {}
        self.num_preemptions = 0
        self.num_ahead = 0              # items planned while the sequence's step before ran
        self.num_discarded = 0          # outputs dropped: their sequence had finished meanwhile

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue a sequence; `first`: ahead of the others (a probe, whose request waits on it)."""
        if len(seq) >= self.max_model_len:
            raise ValueError(f"prompt has {len(seq)} tokens; this model accepts at most "
                             f"{self.max_model_len - 1} (context {self.max_model_len} including output)")
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def schedule(self, drafts: dict[int, Draft] | None = None) -> SchedulerOutput:
        """This step's items; `drafts` (by seq_id) are verified as far as budget, blocks and
        windows allow."""
        budget, drafts = self.max_num_batched_tokens, drafts or {}
        scheduled: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0 or seq.waits_for_probe:
                continue
            if item := self._plan(seq, budget, scheduled, drafts.get(seq.seq_id)):
                scheduled.append(item)
                budget -= item.num_tokens
        scheduled.sort(key=lambda s: not s.samples or s.num_tokens - s.num_draft > 1)      # decodes first
        budget = self.max_num_batched_tokens - sum(s.num_tokens for s in scheduled)
        self._admit(budget, scheduled)
        for item in scheduled:
            self.in_flight[item.seq.seq_id] = item
        return SchedulerOutput(scheduled)

    def _plan(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq],
              draft: Draft | None = None) -> ScheduledSeq | None:
        """A running sequence's share of the step: a prefill chunk, or its newest token and a
        draft to verify; blocks for it (preempting the latest admitted when they run out).
        None when it was preempted itself, or waits for its step in flight.

        A sequence whose step is still in flight (async scheduling) is planned as if that step
        had produced its one token: a placeholder, which the runner fills in from that step's
        output on the device."""
        start, length, prev = seq.num_computed_tokens, len(seq), self.in_flight.get(seq.seq_id)
        if prev is not None:
            if not self._ahead(seq, prev):
                return None
            start, length = prev.start + prev.num_tokens, length + prev.samples
            self.num_ahead += 1
        prefill = length - start > 1
        n = min(length - start, budget) if prefill else 1
        shift = self.bm.evict(seq, start)
        if shift is None:               # no blocks for the copy of its sinks
            self._preempt(seq)
            return None
        while not self.bm.resize(seq, length if seq.window is None else start + n):
            victim = self.running[-1]
            self._preempt(victim)
            scheduled[:] = [s for s in scheduled if s.seq is not victim]
            if victim is seq:
                return None
        item = ScheduledSeq(seq, start, n, start + n == length, shift=shift,
                            placeholder=prev is not None and prev.samples)
        if not prefill and draft is not None:
            k = min(len(draft.tokens), budget - 1)
            if seq.window is not None:
                k = min(k, seq.window.last_position(start, self.bm.block_size) - start)
            if k > 0 and self.bm.resize(seq, len(seq) + k):     # and blocks for the draft's
                item.num_tokens, item.draft, item.draft_probs = 1 + k, draft.tokens[:k], draft.probs
        return item

    def _ahead(self, seq: Sequence, prev: ScheduledSeq) -> bool:
        """Whether a sequence can be planned while its step `prev` runs: not after a draft (its
        accepted count is unknown), not in a thinking span (the stop checker may rewrite its
        tail and the sampler reads its tokens), not when that step's token ends it by length."""
        if prev.num_draft or seq.thinking is not None:
            return False
        return not prev.samples or len(seq) + 1 < min(seq.num_prompt_tokens + seq.params.max_tokens,
                                                      self.max_model_len)

    def _admit(self, budget: int, chunks: list[ScheduledSeq]) -> None:
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.seq_id in self.in_flight or seq.waits_for_probe:   # its token, or its probe, comes first
                continue
            if not self.bm.can_allocate(seq, len(seq) if seq.window is None else min(len(seq), budget)):
                seq.waited_steps += 1
                # Aging: once overtaken long enough, later requests wait so its blocks can free up.
                if seq.waited_steps >= self.max_wait_steps:
                    break
                continue
            self.waiting.remove(seq)
            self.bm.allocate(seq, None if seq.window is None else 0)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            if item := self._plan(seq, budget, chunks):
                chunks.append(item)
                budget -= item.num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, sched: SchedulerOutput, out: RunnerOutput) -> list[Update]:
        """Apply what the runner produced: advance computed counts, append the new tokens
        (accepted drafts, then the step's own token) and their log-probabilities, give back the
        rejected drafts' blocks, record failures, and apply the stop checker's verdict."""
        updates: list[Update] = []
        for item, tokens, logprobs, error in zip(sched.items, out.token_ids, out.logprobs, out.errors):
            seq = item.seq
            if self.in_flight.get(seq.seq_id) is item:
                del self.in_flight[seq.seq_id]
            if seq.is_finished:         # finished (or aborted) while its step ran
                self.num_discarded += 1
                continue
            first = len(seq)
            seq.token_ids.extend(tokens)
            # A sequence preempted while its step ran keeps the token; its KV is recomputed.
            if seq.status is Status.RUNNING:
                # The chunk's own tokens have KV now, and so do the accepted drafts (new tokens but the last).
                seq.num_computed_tokens += item.num_tokens - item.num_draft + max(len(tokens) - 1, 0)
                self.bm.register_computed(seq)
                if item.num_draft:
                    self.bm.resize(seq, len(seq))
            seq.error = seq.error or error
            verdict = None
            if tokens:
                with isolated(seq):
                    verdict = self.stop.check(seq, first)
            if verdict and verdict.forced:
                self.replace_tail(seq, verdict.keep, verdict.forced)
            elif verdict:
                del seq.token_ids[verdict.keep:]
                self.finish(seq, verdict.reason)
            if tokens or seq.error:
                new = logprobs[:max(len(seq) - first, 0)]
                seq.logprobs.extend(new)
                updates.append((seq, first, new))
        return updates

    def replace_tail(self, seq: Sequence, length: int, tokens: list[int]) -> None:
        """Cut a running sequence back to `length` tokens and append `tokens` (budget forcing, early exit);
        they are computed as a chunk on the next step. A block the cut falls inside is given
        back and its kept tokens recomputed in a fresh one: it may be cached and shared, so it
        must never be written again."""
        full = length // self.bm.block_size
        del seq.token_ids[length:]
        seq.token_ids.extend(tokens)
        if seq.status is not Status.RUNNING:    # preempted: it holds no blocks and recomputes all
            return
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
            return []
        if seq in self.running:
            self.running.remove(seq)
            forgotten = self.bm.free_seq(seq, forget=reason == "error")
            seq.num_computed_tokens = 0
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        return forgotten

    # ---- the speculator's shadows ---------------------------------------------------------
    # A shadow is the draft model's copy of a target sequence. The speculator runs it on this
    # scheduler's blocks, outside its queues; its tokens and computed count are written here.
    def admit_shadow(self, shadow: Sequence) -> bool:
        """Blocks for a new shadow, reusing the draft model's prefix cache; False: no room."""
        if not self.bm.can_allocate(shadow):
            return False
        self.bm.allocate(shadow)
        shadow.num_computed_tokens = shadow.num_cached_tokens
        return True

    @staticmethod
    def follow(shadow: Sequence, token_ids: list[int]) -> None:
        """The shadow takes the target's tokens; its KV stays valid for the prefix both share."""
        common, limit = 0, min(len(shadow), len(token_ids))
        while common < limit and shadow.token_ids[common] == token_ids[common]:
            common += 1
        shadow.token_ids = list(token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common)

    @staticmethod
    def advance_shadows(sched: SchedulerOutput, out: RunnerOutput) -> None:
        """A draft round computed each shadow's chunk and sampled its next token (a failed one
        gets released). No stop rule and no prefix cache: a shadow's tail is rewritten whenever
        the target's tokens differ from its drafts."""
        for item, tokens in zip(sched.items, out.token_ids):
            if tokens:
                item.seq.num_computed_tokens += item.num_tokens
                item.seq.token_ids.append(tokens[0])
