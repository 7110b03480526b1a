"""The cascade, one orchestration for the gateway and evals: route -> the small model
answers -> its confidence -> below the tenant's threshold, the large model answers, with the
small answer offered as an external speculative draft (when the engine is configured with
the large model as the speculative target), so where the two agree it costs the large model
verification passes, not decode steps, and the answer is still the large model's own.

Streaming: while escalation is possible the small model's tokens are held until its
confidence is known, so a client never sees an answer that is then replaced; the answer
that stands is sent after the verdict (the small one at once, the large one as it streams).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from engine.async_engine import AsyncEngine, StepOutput
from engine.llm_engine import Completion, LLMEngine
from engine.sampling_params import SamplingParams
from router.confidence import ConfidenceModel


@dataclass(frozen=True)
class Verdict:
    """After the first answer: how sure it is, and whether the large model takes over."""
    confidence: float
    calibrated: bool
    escalate: bool
    reason: str


def judge(escalate_to: str | None, threshold: float, confidence: ConfidenceModel, logprobs: list[float]) -> Verdict:
    c = confidence(logprobs)
    sure = f"confidence {c.value:.2f}{'' if c.calibrated else ' (uncalibrated)'}"
    if escalate_to is None:
        return Verdict(c.value, c.calibrated, False, sure)
    if c.value < threshold:
        return Verdict(c.value, c.calibrated, True, f"{sure} < {threshold:.2f}: escalated to {escalate_to}")
    return Verdict(c.value, c.calibrated, False, f"{sure} >= {threshold:.2f}: kept")


def draft_for(engine: LLMEngine, model: str, first: Completion) -> list[int] | None:
    """The first answer's tokens as a draft for `model`, when the engine can verify one."""
    spec = engine.config.speculative
    if spec is None or spec.target != model or not first.token_ids:
        return None
    return list(first.token_ids)


async def run(engine: AsyncEngine, model: str, escalate_to: str | None, verdict_of: Callable[[list[float]], Verdict],
              prompt_for: Callable[[str], list[int]], params: SamplingParams, salt: bytes,
              request_id: str) -> AsyncIterator[StepOutput | Verdict]:
    """The engine outputs of each call, and the Verdict between the first call and the
    escalation. `prompt_for(model)` gives a model's prompt ids (its own chat template).
    Without a possible escalation: the routed model's stream alone, no Verdict."""
    last = None
    async with aclosing(engine.stream(prompt_for(model), params, model, salt, request_id)) as outputs:
        async for out in outputs:
            last = out
            yield out
    if escalate_to is None or last is None or last.completion is None:
        return
    verdict = verdict_of(last.completion.logprobs)
    yield verdict
    if not verdict.escalate:
        return
    draft = draft_for(engine.engine, escalate_to, last.completion)
    async with aclosing(engine.stream(prompt_for(escalate_to), params, escalate_to, salt,
                                      f"{request_id}-escalated", draft=draft)) as outputs:
        async for out in outputs:
            yield out
