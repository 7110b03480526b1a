"""The HTTP server: uvicorn, with a drain before it stops. On the first SIGTERM or Ctrl-C the
gateway stops admitting (503 `shutting_down`, /readyz 503 so a balancer looks elsewhere), lets
what it admitted finish for up to `drain_timeout_s`, cuts the rest with a clear error and
writes their ledger rows; then uvicorn closes its connections and exits. A second signal
stops at once, as uvicorn does."""
from __future__ import annotations

import asyncio

import uvicorn

from gateway.http.app import create_app
from gateway.service import Gateway


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway):
        super().__init__(config)
        self.gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # A signal handler: it runs between two bytecodes of the loop's thread, so the drain is
        # handed to the loop rather than run here.
        if self.gateway.draining or self._loop is None:
            return super().handle_exit(sig, frame)
        self.gateway.draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain(sig, frame)))

    async def _drain(self, sig, frame) -> None:
        try:
            await self.gateway.drain()
        finally:
            super().handle_exit(sig, frame)


def serve(gateway: Gateway, host: str, port: int, banner: str | None = None) -> None:
    app = create_app(gateway, banner=banner)
    try:
        DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="info"), gateway).run()
    except KeyboardInterrupt:     # uvicorn raises the Ctrl-C it drained on again once it has stopped
        pass
