"""Speculative decoding: cheap proposals, verified by the target model in one pass.

Three draft sources, chosen per sequence by measured acceptance and cost:
  - external: a continuation handed in by the caller (an escalated small-model answer);
  - prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n-gram (answers copy retrieved passages), free to compute;
  - draft model: the small model decodes k tokens ahead, on its own paged KV ("shadow"
    sequences in its block manager).
The target verifies [last token, d1..dk] as one chunk. Greedy requests keep the longest
prefix matching the target's argmax and then take the target's token, so the output is the
target's own greedy output. Sampled requests use the standard rejection rule (accept d with
probability min(1, p/q), else sample from max(0, p - q)), so the output is distributed as
the target's. Rolled-back tokens only ever lived past num_computed_tokens, so rollback is
bookkeeping plus returning surplus blocks (done by the scheduler).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampler import probs as sampling_probs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from engine.config import SpecConfig
    from engine.llm_engine import Worker

SOURCES = ("external", "lookup", "model")


@dataclass
class SpecState:
    """Per sequence: the external draft (a continuation of the prompt), and acceptance per source."""
    external: list[int] = field(default_factory=list)
    acceptance: dict[str, float] = field(default_factory=lambda: {"external": 0.9, "lookup": 0.5, "model": 0.7})
    source: str | None = None       # the source of the draft now being verified
    idle_steps: int = 0             # steps since speculation last ran, for re-probing


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    verify_passes: int = 0          # target passes that verified a draft
    tokens_from_verify: int = 0     # tokens those passes produced
    draft_seconds: float = 0.0
    by_source: dict[str, list[int]] = field(default_factory=lambda: {s: [0, 0] for s in SOURCES})

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "verify_passes": self.verify_passes,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
                "tokens_per_verify_pass": self.tokens_from_verify / self.verify_passes if self.verify_passes else None,
                "draft_seconds": self.draft_seconds,
                "by_source": {s: {"proposed": p, "accepted": a} for s, (p, a) in self.by_source.items()}}


class Governor:
    """Whether drafting (model and prompt lookup) pays, measured rather than predicted: the
    target's decoding goodput (tokens its sequences gain per second of drafting plus the
    target step) with drafts and without, per batch-size bucket, each an average of recent
    decode-only steps. Every `period` steps the arm not in use runs for `probe` steps, so a
    change (longer contexts, other batch sizes, a busy machine) is noticed. The cost model
    (best_k) still picks k inside the "on" arm; this guards against it being wrong."""

    BUCKETS = {1: "1", 2: "2-3", 3: "4-7", 4: "8-15", 5: "16+"}     # sequences decoding in the step

    def __init__(self, period: int = 32, probe: int = 4, margin: float = 1.05):
        self.period, self.probe, self.margin = period, probe, margin
        self.rates: dict[tuple[int, bool], float] = {}      # (bucket, drafting) -> tokens/s
        self.steps: dict[int, int] = {}
        self.choice: dict[int, bool] = {}                   # bucket -> drafting, outside probes

    @staticmethod
    def bucket(decoding: int) -> int:
        return min(decoding, 16).bit_length()               # a key of BUCKETS

    def drafting(self, decoding: int) -> bool:
        """Draft this step? Counts the step for the bucket's probing schedule."""
        b = self.bucket(decoding)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        best = self.choice.get(b, True)
        return (not best) if n % self.period >= self.period - self.probe else best

    def record(self, decoding: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        b, rate = self.bucket(decoding), tokens / seconds
        old = self.rates.get((b, drafted))
        self.rates[(b, drafted)] = rate if old is None else 0.7 * old + 0.3 * rate
        on, off = self.rates.get((b, True)), self.rates.get((b, False))
        if on is not None and off is not None:
            # Hysteresis: the arm in use keeps its place unless the other beats it by the margin.
            if self.choice.get(b, True):
                self.choice[b] = on * self.margin >= off
            else:
                self.choice[b] = on >= off * self.margin

    def as_dict(self) -> dict:
        return {self.BUCKETS[b]: {"drafting": self.choice.get(b, True),
                                  "tok_s_drafting": _round(self.rates.get((b, True))),
                                  "tok_s_plain": _round(self.rates.get((b, False)))}
                for b in sorted(self.steps)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def verify(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [k + 1, vocab] of the target at [last, d1..dk]. Returns the accepted drafts
    followed by one token of the target's own (a correction, or a bonus after all k)."""
    k = len(draft)
    if params.greedy:
        target = logits.argmax(-1).tolist()
        a = 0
        while a < k and draft[a] == target[a]:
            a += 1
        return draft[:a] + [target[a]]
    out = []
    for i, d in enumerate(draft):
        p = sampling_probs(logits[i], params)
        q = draft_probs[i] if draft_probs is not None else None     # None: a deterministic proposal
        q_d = q[d].item() if q is not None else 1.0
        if torch.rand((), generator=generator).item() * q_d < p[d].item():
            out.append(d)
            continue
        residual = (p - q).clamp(min=0) if q is not None else p.index_fill(0, torch.tensor([d]), 0.0)
        if residual.sum() <= 0:        # p == q: nothing left to correct towards
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(sampling_probs(logits[k], params), 1, generator=generator)))
    return out


def prompt_lookup(tokens: list[int], k: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest matching suffix n-gram."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = tokens[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []


def best_k(acceptance: float, cost_per_draft: float, verify_cost: float, max_k: int) -> int:
    """The k that maximizes expected tokens per unit of target time; 0 when none beats plain
    decoding. With acceptance a, a k-draft yields (1 - a^(k+1)) / (1 - a) tokens."""
    a = min(acceptance, 0.99)
    best, best_rate = 0, 1.0
    for k in range(1, max_k + 1):
        rate = (1 - a ** (k + 1)) / (1 - a) / (1 + k * (cost_per_draft + verify_cost))
        if rate > best_rate * 1.02:      # a clear gain, not noise
            best, best_rate = k, rate
    return best


class Speculator:
    def __init__(self, config: SpecConfig, target: Worker, draft: Worker | None):
        self.config, self.target, self.draft = config, target, draft
        self.stats = SpecStats()
        self.governor = Governor() if config.govern else None
        self.step_drafting = True                  # the governor's call for this step
        self.step_draft_seconds = 0.0
        self.shadows: dict[int, Sequence] = {}     # target seq_id -> its sequence in the draft model
        # Seconds of one draft round over one target step: measured unless configured.
        self.draft_cost = config.draft_cost if config.draft_cost is not None else 0.35
        self.target_step = None                    # seconds of a target step without drafts
        # What one more verified token adds to a target step, relative to a plain one: measured
        # unless configured (a k+1-token pass can cost several decode steps on a CPU).
        self.verify_cost = config.verify_cost if config.verify_cost is not None else 0.05

    # ---- proposing ------------------------------------------------------------------
    def propose(self) -> None:
        """Give decode-ready sequences of the target a draft for this step (or none)."""
        cfg = self.config
        by_model: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.target.scheduler.running if s.status is Status.RUNNING and not s.in_prefill]
        self.step_draft_seconds = 0.0
        self.step_drafting = self.governor.drafting(len(decoding)) if self.governor and decoding else True
        for seq in decoding:
            if seq.spec is None:
                continue
            st, seq.draft, seq.draft_probs, st.source = seq.spec, [], None, None
            if (room := _room(seq, self.target.scheduler.max_model_len)) <= 0:
                continue
            if st.external:
                # The external draft continues the prompt; it stays in use while the output so
                # far is its prefix (the prefill's token, accepted drafts, corrections). It
                # costs no drafting, so the governor does not hold it back.
                made = len(seq) - seq.num_prompt_tokens
                if st.external[:made] == seq.output_ids and len(st.external) > made:
                    seq.draft, st.source = st.external[made:made + min(room, cfg.max_external_k)], "external"
                    continue
                st.external = []
            if not self.step_drafting:
                continue
            options = []
            if cfg.prompt_lookup:
                k = min(best_k(st.acceptance["lookup"], 0.0, self.verify_cost, cfg.max_k), room)
                if k == 0 and st.idle_steps >= cfg.probe_every:
                    k = 1
                if k and (found := prompt_lookup(seq.token_ids, k, cfg.max_ngram, cfg.min_ngram)):
                    options.append(("lookup", found, _rate(st.acceptance["lookup"], len(found), self.verify_cost)))
            if self.draft is not None:
                k = min(best_k(st.acceptance["model"], self.draft_cost, self.verify_cost, cfg.max_k), room)
                if k == 0 and st.idle_steps >= cfg.probe_every:
                    k = 1                  # re-probe now and then: acceptance may have recovered
                if k:
                    options.append(("model", k, _rate(st.acceptance["model"], k, self.draft_cost + self.verify_cost)))
            if not options:
                st.idle_steps += 1
                continue
            st.idle_steps = 0
            source, what, _ = max(options, key=lambda o: o[2])
            st.source = source
            if source == "lookup":
                seq.draft = what
            else:
                by_model.append((seq, what))
        if by_model:
            self._draft_with_model(by_model)

    def _draft_with_model(self, wanted: list[tuple[Sequence, int]]) -> None:
        start = time.perf_counter()
        runner = self.draft.runner
        active: list[tuple[Sequence, Sequence, int]] = []
        for seq, k in wanted:
            shadow = self._sync_shadow(seq, k)
            if shadow is None:
                seq.spec.source = None
                continue
            active.append((seq, shadow, k))
        rounds = 0
        while active:
            items = [ScheduledSeq(sh, len(sh) - sh.num_computed_tokens) for _, sh, _ in active]
            sampled, rows = runner.run(items, return_probs=True)
            rounds += 1
            still = []
            for (seq, sh, k), item in zip(active, items):
                if sh.error:          # the draft model failed on it: no draft, a fresh shadow next time
                    seq.draft, seq.draft_probs, seq.spec.source = [], None, None
                    self.release(seq, failed=True)
                    continue
                sh.num_computed_tokens += item.num_tokens
                token = sampled[sh.seq_id][0][0]
                seq.draft.append(token)
                if not seq.params.greedy:
                    seq.draft_probs = rows[sh.seq_id] if seq.draft_probs is None else \
                        torch.cat([seq.draft_probs, rows[sh.seq_id]])
                sh.token_ids.append(token)
                if len(seq.draft) < k:
                    still.append((seq, sh, k))
            active = still
        elapsed = time.perf_counter() - start
        self.stats.draft_seconds += elapsed
        self.step_draft_seconds += elapsed
        if self.target_step and rounds and self.config.draft_cost is None:
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * (elapsed / rounds) / self.target_step

    def _sync_shadow(self, seq: Sequence, k: int) -> Sequence | None:
        """The draft model's copy of `seq`, its cache valid for the prefix both agree on, with
        blocks for k more tokens; None when the draft model has no room."""
        bm = self.draft.block_manager
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(list(seq.token_ids), seq.params, salt=seq.salt, request_id=f"draft-{seq.request_id}")
            if not bm.can_allocate(shadow):
                return None
            bm.allocate(shadow)        # reuses the draft model's prefix cache (same salt)
            self.shadows[seq.seq_id] = shadow
        else:
            common = 0
            limit = min(len(shadow), len(seq))
            while common < limit and shadow.token_ids[common] == seq.token_ids[common]:
                common += 1
            shadow.token_ids = list(seq.token_ids)
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, common)
        # Room for the tokens to catch up on and the k - 1 drafts it computes after them.
        if not bm.resize(shadow, len(shadow) + k - 1):
            self.release(seq)
            return None
        return shadow

    # ---- after verification ---------------------------------------------------------
    def observe(self, item: ScheduledSeq, tokens: list[int]) -> None:
        st = item.seq.spec
        k = item.num_draft
        if not k or st is None or st.source is None:
            return
        accepted = len(tokens) - 1
        st.acceptance[st.source] = 0.7 * st.acceptance[st.source] + 0.3 * (accepted / k)
        s = self.stats
        s.proposed += k
        s.accepted += accepted
        s.verify_passes += 1
        s.tokens_from_verify += len(tokens)
        s.by_source[st.source][0] += k
        s.by_source[st.source][1] += accepted

    def observe_target_step(self, seconds: float, scheduled: list[ScheduledSeq], sampled: dict) -> None:
        """A target step's time and what it ran: plain steps set the unit of cost, verifying
        ones what each extra token adds to it; decode-only steps feed the governor."""
        drafted_tokens = sum(i.num_draft for i in scheduled)
        decode_only = all(i.num_tokens == 1 + i.num_draft for i in scheduled)
        external = any(i.seq.spec is not None and i.seq.spec.source == "external" for i in scheduled if i.num_draft)
        if self.governor and decode_only and not external:
            tokens = sum(len(sampled[i.seq.seq_id][0]) for i in scheduled if i.seq.seq_id in sampled)
            # Judged by what the step did: an "on" step whose sequences all chose k = 0 was plain.
            self.governor.record(len(scheduled), drafted_tokens > 0, tokens, seconds + self.step_draft_seconds)
        if not drafted_tokens:
            self.target_step = seconds if self.target_step is None else 0.8 * self.target_step + 0.2 * seconds
        elif self.target_step and self.config.verify_cost is None:
            extra = max(0.0, seconds / self.target_step - 1) / drafted_tokens
            self.verify_cost = 0.8 * self.verify_cost + 0.2 * extra

    def release(self, seq: Sequence, failed: bool = False) -> None:
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


def _rate(acceptance: float, k: int, cost_per_token: float) -> float:
    a = min(acceptance, 0.99)
    return (1 - a ** (k + 1)) / (1 - a) / (1 + k * cost_per_token)
