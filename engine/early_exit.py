"""Early exit from thinking: a request that thinks stops once its answer has settled.

Every `ThinkingExit.every` thinking tokens the request forks a probe: its tokens so far plus the
closing marker, a new sequence that the prefix cache serves all but the last partial block of,
so it costs its own few tokens. The probe reads the whole answer greedily, to its end (eos or a
stop token) within `answer_tokens`, and its confidence: the 25th percentile of those tokens'
probabilities, the cascade's default rule. An answer longer than that is not judged: its first
tokens (a first line such as "The final answer is") need not hold the answer. The request
waits meanwhile, so that an exit lands exactly where the probe forked: when the last `agree`
probes read the same answer, every one whole, and the last is at least `confidence` sure, the
span is closed there with the same marker and the last probe's answer is the request's: greedy
decoding would write it again from there, so it is taken as it is (where it ended on one of the
request's own stop tokens; else the answer is generated from the marker). Answers
are compared by their last number when they hold one, else by their words: the question is
whether the answer changed, not its wording.

A probe is billed: the marker and the answer tokens it read count as probe tokens of the
request, but for the answer taken, which counts as its answer. A request without early exit, or
without thinking, forks nothing.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from engine.sampling_params import SamplingParams
from engine.sequence import Probe, Sequence

if TYPE_CHECKING:
    from engine.worker import Worker

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def answer_key(text: str) -> str:
    """What two probes must share to agree: the answer's last number, else its words."""
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else " ".join(text.lower().split())


def answer_confidence(logprobs: list[float]) -> float:
    """The 25th percentile of the tokens' probabilities (0 for an empty answer: nothing to trust)."""
    return float(np.exp(np.percentile(logprobs, 25))) if logprobs else 0.0


def settled(probes: list[Probe], agree: int, confidence: float) -> bool:
    """The last `agree` probes read the same answer, each to its end, the last at least
    `confidence` sure: thinking may end (the router lab replays observed probes with it)."""
    last = probes[-agree:]
    return (len(last) == agree and all(p.complete for p in last) and last[-1].confidence >= confidence
            and len({answer_key(p.text) for p in last}) == 1)


class Prober:
    """One model's probes: forks them, reads them, and closes a span whose answer settled."""

    def __init__(self, worker: Worker):
        self.worker, self.stop, self.scheduler, self.tok = worker, worker.stop, worker.scheduler, worker.tokenizer
        self.close = self.tok.encode(worker.thinking.early_close)
        self.num_probes = self.num_exits = self.num_probe_tokens = 0

    def after_step(self, seq: Sequence) -> None:
        """A request's step was applied: fork a probe when one is due."""
        th, ee = seq.thinking, seq.params.thinking_exit
        if ee is None or th is None or th.end is not None or th.probe is not None or seq.is_finished:
            return
        thought = th.num_tokens(len(seq))
        if thought < (th.next_probe or ee.first or ee.every):
            return
        th.next_probe = thought + ee.every
        tokens = min(ee.answer_tokens, seq.params.max_tokens)      # an answer it may take stays within max_tokens
        probe = Sequence(seq.token_ids + self.close, SamplingParams(max_tokens=tokens), salt=seq.salt,
                         request_id=f"{seq.request_id}/probe{len(th.probes)}", probe_of=seq,
                         stop_ids=seq.stop_ids | self.stop.eos_ids)     # an answer ends at eos, ignored or not
        try:
            self.scheduler.add(probe, first=True)
        except ValueError:          # no room left in the context for a probe: thinking goes on
            return
        th.probe = probe
        self.num_probes += 1

    def read(self, probe: Sequence) -> tuple[Sequence, int, list[float]] | None:
        """A probe's step was applied: once it has finished, record it and decide for its
        request, which goes on thinking or answers from where it forked. Returns the request's
        update (the sequence, its length before, its new log-probabilities) when it took the
        probe's answer and finished."""
        if probe.error:         # what it wrote may hold NaNs: its blocks are zeroed, its request goes on
            self.worker.runner.clear(self.scheduler.finish(probe, "error"))
        if not probe.is_finished:
            return None
        seq, th, ee = probe.probe_of, probe.probe_of.thinking, probe.probe_of.params.thinking_exit
        th.probe = None
        if probe.error or seq.is_finished:
            return None
        answer = probe.token_ids[probe.num_prompt_tokens:]
        whole = probe.finish_reason == "stop"
        text = answer[:-1] if whole else answer         # not the stop token
        cost = len(self.close) + len(answer)
        th.probes.append(Probe(th.num_tokens(len(seq)), self.tok.decode(text).strip(),
                               answer_confidence(probe.logprobs[:len(text)]), whole, cost))
        self.num_probe_tokens += cost
        if ee.observe or not settled(th.probes, ee.agree, ee.confidence):
            return None
        self.num_exits += 1
        length = len(seq)
        verdict = self.stop.close_early(th, length)
        if not (whole and answer[-1] in seq.stop_ids):      # it ended where the request would not
            self.scheduler.replace_tail(seq, verdict.keep, verdict.forced)
            return None
        th.probes[-1] = replace(th.probes[-1], taken=True)
        self.num_probe_tokens -= cost
        seq.token_ids.extend(probe.token_ids[length:])
        seq.logprobs.extend(probe.logprobs)
        self.scheduler.finish(seq, "stop")
        return seq, length, list(probe.logprobs)

    def drop(self, seq: Sequence) -> None:
        """Its request is gone (aborted): so is its probe."""
        if seq.thinking is not None and seq.thinking.probe is not None:
            self.scheduler.finish(seq.thinking.probe, "abort")
            seq.thinking.probe = None
