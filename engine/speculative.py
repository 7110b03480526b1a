"""Speculative decoding: cheap proposals, verified by the target model in one pass.

Three draft sources, chosen per sequence by measured acceptance and cost: external (a
continuation from the caller: an escalated small-model answer); prompt lookup (what followed
the latest earlier occurrence of the last n-gram: answers copy retrieved passages), free; the
draft model (k tokens ahead on its own paged KV, "shadow" sequences). The target verifies
[last token, d1..dk] as one chunk (sampler.verify): greedy output is the target's own,
sampled output is distributed as the target's. Drafts travel in the step's record (step.py),
never in a sequence's tokens, and their KV lies past num_computed_tokens, so rollback is
returning surplus blocks.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.config import SpecConfig
from engine.sequence import Sequence, SpecState, Status
from engine.step import Draft, RunnerOutput, ScheduledSeq, SchedulerOutput
from engine.worker import Worker


@dataclass
class SpecStats:
    verify_passes: int = 0          # target passes that verified a draft
    tokens_from_verify: int = 0     # tokens those passes produced
    draft_seconds: float = 0.0
    by_source: dict[str, list[int]] = field(                        # source -> [proposed, accepted]
        default_factory=lambda: {s: [0, 0] for s in ("external", "lookup", "model")})

    def as_dict(self) -> dict:
        proposed, accepted = (sum(counts) for counts in zip(*self.by_source.values()))
        return {"proposed": proposed, "accepted": accepted, "verify_passes": self.verify_passes,
                "acceptance_rate": accepted / proposed if proposed else None,
                "tokens_per_verify_pass": self.tokens_from_verify / self.verify_passes if self.verify_passes else None,
                "draft_seconds": self.draft_seconds,
                "by_source": {s: {"proposed": p, "accepted": a} for s, (p, a) in self.by_source.items()}}


@dataclass
class _Bucket:
    """The governor's state for one batch-size bucket."""
    tokens: dict[str, float] = field(default_factory=dict)     # discounted tokens per arm
    seconds: dict[str, float] = field(default_factory=dict)    # discounted seconds per arm
    best: str | None = None
    arm: str | None = None          # the arm running now
    left: int = 0                   # steps it still runs as a probe
    steps: int = 0
    probing: bool = False           # the arm running is on trial
    best_before_probe: str | None = None
    next_probe: int = 0             # the step at which the next re-try starts
    period: int = 0
    probes: int = 0

    def rate(self, arm: str) -> float | None:
        return self.tokens[arm] / self.seconds[arm] if self.seconds.get(arm) else None


class Governor:
    """Which drafting pays, measured rather than predicted, per batch-size bucket. The arms
    are plain decoding, prompt lookup alone, and every source (the cost model then picks per
    sequence, the draft model included). An arm's goodput is tokens per second of drafting
    plus target step over decode-only steps, recent ones weighted most; the draft model's
    catch-up prefills land in it, so a source is judged by everything it spends.

    A bucket first runs each arm for `probe` steps, so it decides within probe x arms steps.
    Then it runs the best (5% hysteresis) and re-tries the others, `probe` steps each, every
    `period` steps; a re-try that leaves the choice as it was doubles the period (up to
    `max_period`), so a losing arm costs less and less, and one that changes it resets it."""

    BUCKETS = {1: "1", 2: "2-3", 3: "4-7", 4: "8-15", 5: "16+"}     # sequences decoding in the step

    def __init__(self, arms: list[str], probe: int = 3, period: int = 32, max_period: int = 1024,
                 margin: float = 1.05, decay: float = 0.7):
        self.arms, self.probe, self.period, self.max_period = arms, probe, period, max_period
        self.margin, self.decay = margin, decay
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(decoding: int) -> int:
        return min(decoding, 16).bit_length()               # a key of BUCKETS

    def arm(self, decoding: int) -> str:
        """The arm for this step (counting it for the bucket's schedule)."""
        b = self.buckets.setdefault(self.bucket(decoding), _Bucket(period=self.period))
        b.steps += 1
        if b.left > 0:
            b.left -= 1
            return b.arm
        if untried := [a for a in self.arms if a not in b.seconds]:
            return self._probe(b, untried[0])
        if b.probing:                   # the first tries or a re-try just ended
            b.probing = False
            b.period = min(2 * b.period, self.max_period) if b.best == b.best_before_probe else self.period
            b.next_probe = b.steps + b.period
        elif b.steps >= b.next_probe and (others := [a for a in self.arms if a != b.best]):
            b.probes += 1
            return self._probe(b, others[(b.probes - 1) % len(others)])
        b.arm = b.best
        return b.arm

    def _probe(self, b: _Bucket, arm: str) -> str:
        if not b.probing:
            b.best_before_probe, b.probing = b.best, True
        b.arm, b.left = arm, self.probe - 1
        return arm

    def record(self, decoding: int, arm: str, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        b = self.buckets.setdefault(self.bucket(decoding), _Bucket(period=self.period))
        b.tokens[arm] = self.decay * b.tokens.get(arm, 0.0) + tokens
        b.seconds[arm] = self.decay * b.seconds.get(arm, 0.0) + seconds
        best = max(b.seconds, key=b.rate)
        if b.best is None or b.best not in b.seconds or b.rate(best) > b.rate(b.best) * self.margin:
            b.best = best

    def as_dict(self) -> dict:
        return {self.BUCKETS[k]: {"arm": b.best, "probe_period": b.period,
                                  "tok_s": {a: round(b.rate(a), 2) for a in b.seconds}}
                for k, b in sorted(self.buckets.items())}


def prompt_lookup(tokens: list[int], k: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest matching suffix n-gram."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = tokens[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def best_k(acceptance: float, cost_per_draft: float, verify_cost: float, max_k: int) -> int:
    """The k that maximizes expected tokens per unit of target time; 0 when none beats plain
    decoding."""
    best, best_rate = 0, 1.0
    for k in range(1, max_k + 1):
        rate = _rate(acceptance, k, cost_per_draft + verify_cost)
        if rate > best_rate * 1.02:      # a clear gain, not noise
            best, best_rate = k, rate
    return best


def _rate(acceptance: float, k: int, cost_per_token: float) -> float:
    """Tokens per unit of target time of a k-draft: with acceptance a it yields
    (1 - a^(k+1)) / (1 - a) tokens."""
    a = min(acceptance, 0.99)
    return (1 - a ** (k + 1)) / (1 - a) / (1 + k * cost_per_token)


class Speculator:
    def __init__(self, config: SpecConfig, target: Worker, draft: Worker | None):
        if draft is not None and draft.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
            raise ValueError(f"draft model {draft.name!r} cannot draft for {target.name!r}: their tokenizers differ")
        self.config, self.target, self.draft = config, target, draft
        self.stats = SpecStats()
        arms = ["plain"] + ["lookup"] * config.prompt_lookup + \
            ["lookup+model" if config.prompt_lookup else "model"] * (draft is not None)
        self.governor = Governor(arms) if config.govern else None
        self.step_draft_seconds = 0.0
        self.step_arm = arms[-1]
        self.shadows: dict[int, Sequence] = {}     # target seq_id -> its sequence in the draft model
        self.draft_vocab = draft.runner.sub_vocab(config.draft_vocab, draft.stop.eos_ids) \
            if draft is not None and config.draft_vocab > 0 else None
        # Costs relative to a plain target step (target_step seconds): measured unless configured.
        self.draft_cost = 0.35 if config.draft_cost is None else config.draft_cost
        self.verify_cost = 0.05 if config.verify_cost is None else config.verify_cost
        self.draft_prefill_cost = 0.02 if config.draft_prefill_cost is None else config.draft_prefill_cost
        self.target_step: float | None = None
        # Target seconds per prefill token: until the draft model has caught up once, its
        # catch-up is priced from the target's own prefills, scaled by its step cost (the
        # fixed prior above under-priced it 4-6x on a CPU, and a cold server paid for that).
        self.target_prefill: float | None = None
        self.catch_up_measured = config.draft_prefill_cost is not None
        # Output lengths of the target's finished requests: how long an answer still runs.
        self.lengths: deque[int] = deque(maxlen=256)

    def propose(self) -> dict[int, Draft]:
        """Drafts for this step, by seq_id, for the target's decode-ready sequences that get one."""
        cfg = self.config
        drafts: dict[int, Draft] = {}
        by_model: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.target.scheduler.running
                    if s.status is Status.RUNNING and not s.in_prefill and not s.waits_for_probe]
        self.step_draft_seconds = 0.0
        self.step_arm = arm = self.governor.arm(len(decoding)) if self.governor and decoding else self.step_arm
        for seq in decoding:
            if seq.spec is None:
                continue
            st = seq.spec
            st.source = None
            if (room := _room(seq, self.target.scheduler.max_model_len)) <= 0:
                continue
            if st.external:
                # The external draft continues the prompt; it stays in use while the output so
                # far is its prefix (the prefill's token, accepted drafts, corrections). It
                # costs no drafting, so the governor does not hold it back.
                made = len(seq) - seq.num_prompt_tokens
                if st.external[:made] == seq.token_ids[seq.num_prompt_tokens:] and len(st.external) > made:
                    drafts[seq.seq_id], st.source = Draft(st.external[made:made + min(room, cfg.max_external_k)]), \
                        "external"
                    continue
                st.external = []
            options = []
            if "lookup" in arm and (k := self._k(st, "lookup", 0.0, room)) and \
                    (found := prompt_lookup(seq.token_ids, k, cfg.max_ngram, cfg.min_ngram)):
                options.append(("lookup", found, _rate(st.acceptance["lookup"], len(found), self.verify_cost)))
            if "model" in arm and (k := self._k(st, "model", self.draft_cost, room)) and self._model_pays(seq, k):
                options.append(("model", k, _rate(st.acceptance["model"], k, self.draft_cost + self.verify_cost)))
            if not options:
                st.idle_steps += 1
                continue
            st.idle_steps = 0
            st.source, what, _ = max(options, key=lambda o: o[2])
            if st.source == "lookup":
                drafts[seq.seq_id] = Draft(what)
            else:
                by_model.append((seq, what))
        if by_model:
            self._draft_with_model(by_model, drafts)
        return drafts

    def _k(self, st: SpecState, source: str, cost_per_draft: float, room: int) -> int:
        """How many drafts of `source` pay; now and then one when none do (acceptance may recover)."""
        k = best_k(st.acceptance[source], cost_per_draft, self.verify_cost, self.config.max_k)
        return min(room, k or int(st.idle_steps >= self.config.probe_every))

    def _model_pays(self, seq: Sequence, k: int) -> bool:
        """Whether the draft model earns back what it must first spend on this sequence: a
        prefill of every token its cache lacks (the whole prompt, for a new one), against what
        drafting saves per token times the tokens the answer is expected still to run."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is not None and len(seq) - 1 - shadow.num_computed_tokens <= k:
            return True                         # in step: nothing to pay back
        rate = _rate(seq.spec.acceptance["model"], k, self.draft_cost + self.verify_cost)
        made = len(seq) - seq.num_prompt_tokens
        saved = (1 - 1 / rate) * self.expected_remaining(made, _room(seq, self.target.scheduler.max_model_len))
        # Tokens of catch-up that saving pays for (a measured cost may come out as 0).
        affordable = saved / self.draft_prefill_cost if self.draft_prefill_cost > 0 else math.inf
        if len(seq) - 1 <= affordable:          # even a cold start pays: no need to ask the cache
            return True
        have = shadow.num_computed_tokens if shadow is not None else \
            self.draft.block_manager.num_cached_tokens(seq.token_ids, seq.salt)
        return len(seq) - 1 - have < affordable

    def expected_remaining(self, made: int, room: int) -> float:
        """Tokens an answer that has `made` so far is expected still to produce: the mean over
        recent finished answers longer than that; with fewer than 8 of those, as many again as
        it has made (so the draft model starts once the answer has run long enough to pay for
        it: at most twice the cost of knowing the length in advance)."""
        longer = [n - made for n in self.lengths if n > made]
        return min(room, sum(longer) / len(longer) if len(longer) >= 8 else made)

    def _draft_with_model(self, wanted: list[tuple[Sequence, int]], drafts: dict[int, Draft]) -> None:
        start = time.perf_counter()
        active = [(seq, sh, k) for seq, k in wanted if (sh := self._sync_shadow(seq, k)) is not None]
        for seq, _, _ in active:
            drafts[seq.seq_id] = Draft([])
        while active:
            items = []
            for seq, sh, k in list(active):
                # The shadow's own window; blocks for its sinks' copy are there or it drafts nothing.
                if (shift := self.draft.block_manager.evict(sh, sh.num_computed_tokens)) is None:
                    self._drop_draft(seq, drafts)
                    active.remove((seq, sh, k))
                    continue
                n = len(sh) - sh.num_computed_tokens
                items.append(ScheduledSeq(sh, sh.num_computed_tokens, n, True, shift=shift))
            if not active:
                break
            round_start = time.perf_counter()
            sched = SchedulerOutput(items)
            out = self.draft.runner.run(sched, return_probs=True, vocab=self.draft_vocab)
            self._observe_draft_round(time.perf_counter() - round_start, items)
            self.draft.scheduler.advance_shadows(sched, out)
            for (seq, sh, k), tokens, probs, error in zip(active, out.token_ids, out.probs, out.errors):
                if error:             # the draft model failed on it: no draft, a fresh shadow next time
                    self._drop_draft(seq, drafts, failed=True)
                    continue
                draft = drafts[seq.seq_id]
                draft.tokens.append(tokens[0])
                if not seq.params.greedy:
                    draft.probs = probs if draft.probs is None else torch.cat([draft.probs, probs])
            active = [(seq, sh, k) for seq, sh, k in active
                      if seq.seq_id in drafts and len(drafts[seq.seq_id].tokens) < k]
        elapsed = time.perf_counter() - start
        self.stats.draft_seconds += elapsed
        self.step_draft_seconds += elapsed

    def _drop_draft(self, seq: Sequence, drafts: dict[int, Draft], failed: bool = False) -> None:
        del drafts[seq.seq_id]
        seq.spec.source = None
        self.release(seq, failed)

    def _observe_draft_round(self, seconds: float, items: list[ScheduledSeq]) -> None:
        """A draft-model pass, in target steps: one token per sequence is a draft step (its
        cost), more are catch-up prefill (its cost per extra token)."""
        if not self.target_step:
            return
        extra = sum(i.num_tokens for i in items) - len(items)
        if extra <= 0:
            if self.config.draft_cost is None:
                self.draft_cost = 0.8 * self.draft_cost + 0.2 * seconds / self.target_step
        elif self.config.draft_prefill_cost is None:
            per_token = max(0.0, seconds / self.target_step - self.draft_cost) / extra
            self.draft_prefill_cost = 0.7 * self.draft_prefill_cost + 0.3 * per_token if self.catch_up_measured \
                else per_token
            self.catch_up_measured = True

    def _sync_shadow(self, seq: Sequence, k: int) -> Sequence | None:
        """The draft model's copy of `seq`, its cache valid for the prefix both agree on, with
        blocks for k more tokens; None (and no draft) when the draft model has no room."""
        bm = self.draft.block_manager
        shadow = self.shadows.get(seq.seq_id)
        if shadow is not None and shadow.num_dropped:
            # A window cannot roll back into what it dropped: then the shadow starts afresh.
            common = next((i for i, (a, b) in enumerate(zip(shadow.token_ids, seq.token_ids)) if a != b),
                          min(len(shadow), len(seq)))
            if common < shadow.window.sink_tokens(bm.block_size) + shadow.num_dropped:
                self.release(seq)
                shadow = None
        if shadow is None:
            shadow = Sequence(list(seq.token_ids), seq.params, salt=seq.salt, request_id=f"draft-{seq.request_id}",
                              window=seq.window)
            if not self.draft.scheduler.admit_shadow(shadow):   # reuses the draft model's prefix cache (same salt)
                seq.spec.source = None
                return None
            self.shadows[seq.seq_id] = shadow
        else:
            self.draft.scheduler.follow(shadow, seq.token_ids)
        # Room for the tokens to catch up on and the k - 1 drafts it computes after them.
        if not bm.resize(shadow, len(shadow) + k - 1):
            self.release(seq)
            seq.spec.source = None
            return None
        return shadow

    def run_target(self, sched: SchedulerOutput) -> RunnerOutput:
        """The target's step, which verifies this step's drafts, timed and observed."""
        start = time.perf_counter()
        out = self.target.runner.run(sched)
        self.observe_target_step(time.perf_counter() - start, sched, out)
        return out

    def observe_target_step(self, seconds: float, sched: SchedulerOutput, out: RunnerOutput) -> None:
        """A target step's time and what it ran: acceptance per sequence and source; plain
        decode steps set the unit of cost, verifying ones what each extra token adds to it, and
        both feed the governor; steps with prompt chunks price prefill."""
        scheduled = sched.items
        for item, tokens in zip(scheduled, out.token_ids):
            st, k = item.seq.spec, item.num_draft
            if k and st is not None and st.source is not None and tokens:
                accepted = len(tokens) - 1
                st.acceptance[st.source] = 0.7 * st.acceptance[st.source] + 0.3 * (accepted / k)
                self.stats.verify_passes += 1
                self.stats.tokens_from_verify += accepted + 1
                self.stats.by_source[st.source][0] += k
                self.stats.by_source[st.source][1] += accepted
        drafted_tokens = sum(i.num_draft for i in scheduled)
        decode_only = all(i.num_tokens == 1 + i.num_draft for i in scheduled)
        if not decode_only:
            self._observe_target_prefill(seconds, scheduled)
        external = any(i.seq.spec is not None and i.seq.spec.source == "external" for i in scheduled if i.num_draft)
        if self.governor and decode_only and not external:
            self.governor.record(len(scheduled), self.step_arm, sum(map(len, out.token_ids)),
                                 seconds + self.step_draft_seconds)
        # Only decode steps price decoding: one prompt chunk costs hundreds of them, and taken
        # into the unit it made drafting and verification look free for the next dozen steps.
        if decode_only and not drafted_tokens:
            self.target_step = seconds if self.target_step is None else 0.8 * self.target_step + 0.2 * seconds
        elif decode_only and self.target_step and self.config.verify_cost is None:
            extra = max(0.0, seconds / self.target_step - 1) / drafted_tokens
            self.verify_cost = 0.8 * self.verify_cost + 0.2 * extra

    def _observe_target_prefill(self, seconds: float, scheduled: list[ScheduledSeq]) -> None:
        """A step with prompt chunks: what a prefill token costs the target, and so, before any
        catch-up was measured, what one costs the draft model (its step's share of the target's)."""
        extra = sum(i.num_tokens - 1 - i.num_draft for i in scheduled)
        if extra < 16:                  # too few tokens to tell from the step's fixed cost
            return
        per_token = max(0.0, seconds - (self.target_step or 0.0)) / extra
        self.target_prefill = per_token if self.target_prefill is None else 0.8 * self.target_prefill + 0.2 * per_token
        if not self.catch_up_measured and self.target_step:
            self.draft_prefill_cost = self.target_prefill / self.target_step * self.draft_cost

    def release(self, seq: Sequence, failed: bool = False) -> None:
        """The request is done (or its shadow failed): its draft-model blocks go back."""
        if seq.is_finished and seq.spec is not None and seq.finish_reason != "abort":
            self.lengths.append(len(seq) - seq.num_prompt_tokens)
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.draft.runner.clear(self.draft.block_manager.free_seq(shadow, forget=failed))


def _room(seq: Sequence, max_model_len: int) -> int:
    """Drafts past this many tokens would be cut anyway (answer length, thinking budget, context)."""
    room = max_model_len - len(seq)
    if seq.answer_start is not None:
        room = min(room, seq.params.max_tokens - (len(seq) - seq.answer_start))
    elif seq.thinking is not None:
        room = min(room, seq.thinking.budget - seq.thinking.num_tokens(len(seq)))
    return room - 1

