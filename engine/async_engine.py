"""Async front: a background task steps the engine in its own thread while each request
reads its tokens from its own queue. Cancelling a stream frees the request's blocks. Every
call into the engine runs on that one thread, so none overlaps a step."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from engine.llm_engine import Completion, LLMEngine, StepOutput
from engine.sampling_params import SamplingParams
from engine.sequence import KVWindow

log = logging.getLogger("sluice.engine")


class EngineFailure(RuntimeError):
    """This request failed in the engine (its own step, or a whole step that could not be
    pinned on one request); the engine itself and the other requests go on."""


class Stopped(RuntimeError):
    """The engine was told to stop serving (`fail_all`) while this request was in flight."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="sluice-step")
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            while self.engine.has_work():
                try:
                    outputs = await loop.run_in_executor(self._stepper, self.engine.step)
                except Exception as exc:                 # keep serving: fail only what was in flight
                    log.exception("engine step failed")
                    await self.fail_all(EngineFailure(f"engine step failed: {exc}"))
                    continue
                for out in outputs:
                    if (queue := self._queues.get(out.request_id)) is not None:
                        queue.put_nowait(out)
            await self._wakeup.wait()

    async def fail_all(self, error: Exception) -> None:
        """End every request in flight now (their blocks go back), each stream raising `error`."""
        loop = asyncio.get_running_loop()
        for request_id, queue in list(self._queues.items()):
            await loop.run_in_executor(self._stepper, self.engine.abort, request_id)
            queue.put_nowait(error)

    async def cut(self, request_id: str) -> Completion | None:
        """End a request now (its stream yields nothing more): what it had produced."""
        return await asyncio.get_running_loop().run_in_executor(self._stepper, self.engine.abort, request_id)

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None, model: str | None = None,
                     salt: bytes = b"", request_id: str | None = None, speculate: bool = True,
                     draft: list[int] | None = None, window: KVWindow | None = None) -> AsyncIterator[StepOutput]:
        """Yields each step's output for this request. Raises ValueError on bad input before
        anything is queued."""
        await self.start()
        loop = asyncio.get_running_loop()
        # The queue exists before the request does: the step thread may emit its first tokens
        # before this coroutine runs again.
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._queues[request_id] = queue = asyncio.Queue()
        adding = loop.run_in_executor(self._stepper, self.engine.add_request, prompt, params, model, salt,
                                      request_id, speculate, draft, window)
        try:
            await asyncio.shield(adding)
        except BaseException:     # refused, or cancelled while queueing: then it must not run unread
            del self._queues[request_id]
            await asyncio.wait([adding])
            if adding.exception() is None:
                await loop.run_in_executor(self._stepper, self.engine.abort, request_id)
            raise
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                if finished and out.completion.finish_reason == "error":
                    raise EngineFailure(out.completion.error)
                yield out
        finally:
            del self._queues[request_id]
            if not finished:   # cancelled or abandoned by the caller: free its blocks now
                await asyncio.shield(loop.run_in_executor(self._stepper, self.engine.abort, request_id))
