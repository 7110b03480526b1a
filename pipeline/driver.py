"""The one loop that puts an Answer's calls through the engine, for the gateway (a request's
stream) and evals (many questions at once) alike:

    next call -> stream its outputs -> observe each (the early verdict may cut it)
    -> finish it (the verdict) -> next call, until the answer stands

`drive` yields the answer text a client may see as it comes, and `Judged` once the cascade's
verdict makes the route final. While an answer may yet be escalated its text is held back
(a client never sees a replaced answer) and follows `Judged` unless escalated. `Progress`
keeps what the engine has produced, so a request that is cut off can still be billed. Past
its `deadline` the call in flight is closed (the engine aborts it and frees its blocks) and
`DeadlineExceeded` is raised.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from engine import Completion, KVWindow, SamplingParams, StepOutput
from pipeline.answer import Answer, EngineCall
from router.confidence import Verdict


class Engine(Protocol):
    """What a driver needs of an engine: engine.AsyncEngine."""

    def stream(self, prompt: list[int], params: SamplingParams, model: str, salt: bytes, request_id: str,
               draft: list[int] | None = None, window: KVWindow | None = None) -> AsyncIterator[StepOutput]: ...

    async def cut(self, request_id: str) -> Completion | None: ...


class DeadlineExceeded(Exception):
    """The answer was not done by its deadline; the call in flight was aborted."""


@dataclass
class Text:
    text: str


@dataclass
class Judged:
    verdict: Verdict


@dataclass
class Progress:
    """What the engine has produced so far, for the ledger even if the client goes away."""
    text: str = ""                          # of the call in flight
    tokens: int = 0                         # of every call
    cached: int = 0                         # of the call in flight's prompt, from the prefix cache
    first_token: float | None = None        # time.monotonic() of the request's first output
    call: EngineCall | None = None          # in flight: not yet in the answer's calls


async def drive(answer: Answer, engine: Engine, progress: Progress,
                deadline: float | None = None) -> AsyncIterator[Text | Judged]:
    """Every call of `answer` through `engine`, done by `deadline` (time.monotonic(); None: no
    deadline). Raises the engine's ValueError for input it refuses (nothing ran), EngineFailure
    for a call that failed while generating, DeadlineExceeded past the deadline."""
    while (call := answer.next_call()) is not None:
        holding, progress.call, progress.text = answer.may_escalate, call, ""
        completion = None
        # aclosing: if our consumer closes us mid-answer, the engine's stream is closed now
        # (aborting the request), not whenever it is garbage-collected.
        async with aclosing(engine.stream(call.prompt_ids, call.params, call.model, call.salt, call.request_id,
                                          draft=call.draft, window=call.window)) as outputs:
            while (out := await _next(outputs, deadline)) is not None:
                if progress.first_token is None:
                    progress.first_token = time.monotonic()
                progress.cached = out.num_cached_tokens
                progress.tokens += len(out.new_token_ids)
                completion = out.completion or completion
                if out.text_delta:
                    progress.text += out.text_delta
                    if not holding:
                        yield Text(out.text_delta)
                early = answer.observe(out)
                if early is not None and early.escalate:     # doomed: cut it short
                    completion = await engine.cut(call.request_id)
                    if completion is not None:
                        break
                    # The step thread finished it before the cut came (the answer ended within
                    # a step of the verdict): its completion is still on its way in this stream.
        progress.call = None
        verdict = answer.finish(completion)
        if verdict is not None:
            yield Judged(verdict)
            if not verdict.escalate and progress.text:
                yield Text(progress.text)


async def _next(outputs: AsyncIterator[StepOutput], deadline: float | None) -> StepOutput | None:
    """The stream's next output, None at its end. A timeout cancels the wait inside the
    stream, which aborts the request there (its blocks are freed before this raises)."""
    try:
        if deadline is None:
            return await anext(outputs)
        return await asyncio.wait_for(anext(outputs), max(0.0, deadline - time.monotonic()))
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise DeadlineExceeded() from None
