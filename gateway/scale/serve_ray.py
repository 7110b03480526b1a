"""Sluice as replicas on Ray Serve: `sluice serve --ray`, or `serve run deploy/serve.yaml`.

Two deployments, the shape Ray's own LLM serving has (an ingress, a deployment handle with
a request router, engine replicas):

- `SluiceReplica`: one gateway each (the Litestar app, its own engine with every model,
  the ledger and limits that all replicas share: PostgreSQL and Redis). Serve places it on
  `replicas.gpus` GPUs (or `replicas.cpus` CPUs), counts it started once its models are
  loaded, asks the gateway for its health, and scales between `replicas.min` and
  `replicas.max` on requests in flight (`replicas.target_ongoing` each).
- `SluiceIngress`: the HTTP front. It reads a request, computes its prefix key
  (serve_requests.PrefixKeys), hands it to a replica through the handle whose router is
  serve_router.AffinityRouter, and streams the replica's ASGI messages back. A replica that
  dies mid-request fails only the requests it held, each with a 503 `replica_failed`. A
  replica that Serve replaces (a new deployment, scaling down) drains: it gets no new
  requests and finishes its own for up to `drain_timeout_s`.
  `/metrics` merges every replica's metrics, each series labelled by `replica`, with the
  router's counts; `/replicas` lists the replicas (id, process id, node).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import ray
import uvicorn
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from uvicorn.lifespan.on import LifespanOn

from gateway.config import ConfigError, ServerConfig
from gateway.errors import body as error_body
from gateway.http.app import create_app
from gateway.metrics import CONTENT_TYPE, Registry, Sampled
from gateway.scale.serve_requests import ROUTERS, Forwarded, Pinned, PrefixKeys
from gateway.service import Gateway
from gateway.tenants import TenantRegistry

log = logging.getLogger("sluice.serve")
REPLICA, INGRESS = "SluiceReplica", "SluiceIngress"
PINNED_TIMEOUT_S = 10.0
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


class SluiceReplica:
    async def __init__(self, config: ServerConfig, tenants: str, data: str):
        if not config.replicas.gpus:
            import torch
            torch.set_num_threads(max(1, int(config.replicas.cpus)))    # not every core of the host
        self.id = serve.get_replica_context().replica_id.unique_id
        registry = TenantRegistry(Path(tenants), set(config.engine.models), config.tenant_reload_interval_s)
        self.gateway = Gateway(config, registry, data)
        self.app = create_app(self.gateway)
        self.lifespan = LifespanOn(uvicorn.Config(self.app, lifespan="on", log_config=None))
        await self.lifespan.startup()
        await self.gateway.wait_ready()          # Serve sends nothing here until this returns

    async def check_health(self) -> None:
        if self.gateway.load_error:
            raise RuntimeError(self.gateway.load_error)

    async def handle(self, request: Forwarded) -> AsyncIterator[dict]:
        """Run one HTTP request through the Litestar app; yield its ASGI messages as they come.
        Closed early (the client went away), the app sees a disconnect and cancels the generation."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query_string, "headers": request.headers, "client": request.client,
                 "server": None, "state": {}}
        outbox: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_read = False

        async def receive() -> dict:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-sluice-replica", self.id.encode())]}
            await outbox.put(message)

        app = asyncio.create_task(self.app(scope, receive, send))
        app.add_done_callback(lambda _: outbox.put_nowait(None))
        try:
            while (message := await outbox.get()) is not None:
                yield message
            await app                             # an error the app did not answer itself
        finally:
            gone.set()
            await asyncio.wait([app])

    def info(self, _: Pinned) -> dict:
        return {"replica": self.id, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "ready": self.gateway.ready, "engine": self.gateway.engine.stats() if self.gateway.engine else {}}

    def metrics(self, _: Pinned) -> str:
        return self.gateway.metrics.render()

    async def __del__(self):
        # Serve calls this once the requests it routed here are done, or not at all: past
        # graceful_shutdown_timeout_s (the drain timeout) it kills the replica, and the ingress
        # answers what it still held with 503 `replica_failed`.
        await self.gateway.drain()
        await self.lifespan.shutdown()


class SluiceIngress:
    def __init__(self, replicas: DeploymentHandle, config: ServerConfig, tenants: str, data: str):
        import torch
        # One thread embeds a question in about 20 ms; two on a busy host spin against the
        # replicas' threads (500 ms measured on 2 cores).
        torch.set_num_threads(1)
        self.replicas, self.streams = replicas, replicas.options(stream=True)
        self.max_body = config.max_body_bytes
        self.keys = PrefixKeys(config, Path(tenants), Path(data))
        self.id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        async def app(scope, receive, send) -> None:     # a plain coroutine function: uvicorn takes it for ASGI 3
            await self.asgi(scope, receive, send)
        return app

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": f"{message['type']}.complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            return await _respond(send, 200, (await self.metrics()).encode(), CONTENT_TYPE)
        if scope["method"] == "GET" and scope["path"] == "/replicas":
            return await _respond(send, 200, json.dumps(await self.replica_info()).encode(), "application/json")
        try:
            data = await _read_body(receive, self.max_body)
        except ClientGone:
            return
        if data is None:
            return await _error(send, 413, f"the request body is larger than {self.max_body} bytes", "body_too_large")
        key = await asyncio.to_thread(self.keys.key, scope["path"], scope["headers"], data)
        request = Forwarded(scope["method"], scope["path"], scope["query_string"], list(scope["headers"]), data,
                            scope.get("client"), key)
        # The start is held back until the first body part: a replica killed between the two
        # would otherwise leave the client with headers and a torn body instead of a 503.
        head, started, answer = None, False, self.streams.handle.remote(request)
        try:
            async for message in answer:
                if message["type"] == "http.response.start":
                    head = message
                    continue
                if head is not None:
                    await send(head)
                    head, started = None, True
                await send(message)
            if head is not None:
                await send(head)
        except RayActorError as e:               # died, or unreachable: its requests are lost
            if started:                          # part of the answer went out: cut the connection
                raise
            log.warning("replica failed mid-request: %s", e)
            await _error(send, 503, "the replica answering this request stopped before it finished (its process "
                                    "died); Serve is replacing it; retry", "replica_failed")
        finally:
            answer.cancel()                      # the client left: the replica stops generating

    async def _pinned(self, method: str) -> dict[str, object]:
        """`method` of every replica the router knows, each called on that replica. One at a
        time: calls made while serving one request share its id, and Serve's router fulfils
        concurrent calls with the same id as one."""
        router = ROUTERS.get(REPLICA)
        if router is None:                       # no request yet: the handle's router starts with one
            await self.replicas.info.remote(None)
            router = ROUTERS[REPLICA]
        results = {}
        for replica in router.replica_ids():
            try:
                call = getattr(self.replicas, method).remote(Pinned(replica))
                results[replica] = await asyncio.wait_for(call, PINNED_TIMEOUT_S)
            except (RayActorError, asyncio.TimeoutError) as e:   # gone since: the others still answer
                log.warning("replica %s did not answer %s: %r", replica, method, e)
        return results

    async def replica_info(self) -> list[dict]:
        return list((await self._pinned("info")).values())

    async def metrics(self) -> str:
        texts = await self._pinned("metrics")
        router = ROUTERS.get(REPLICA)
        counts = router.counts if router else {}
        own = Registry()
        own.add(Sampled("sluice_router_requests_total", "keyed requests by what the router did (affine: to the "
                        "replica that last served the prefix; moved: it was overloaded or gone; new)",
                        ("ingress", "outcome"), lambda: {(self.id, k): v for k, v in counts.items()}, "counter"))
        own.add(Sampled("sluice_router_affinity_hit_rate", "keyed requests sent where their prefix was served last",
                        ("ingress",), lambda: {(self.id,): counts.get("affine", 0) / max(1, sum(counts.values()))}))
        return merge_metrics(texts) + own.render()


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one: each family once, every sample labelled
    with the replica it came from."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                if len(headers.setdefault(family, [])) < 2:
                    headers[family].append(line)
                samples.setdefault(family, [])
            elif (m := SAMPLE.match(line)) and family is not None:
                name, labels, value = m.groups()
                tag = f'replica="{replica}"' + (f",{labels}" if labels else "")
                samples[family].append(f"{name}{{{tag}}} {value}")
    return "".join("\n".join(headers[f] + samples[f]) + "\n" for f in headers)


class ClientGone(Exception):
    """The client closed the connection before its request was read."""


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send, status: int, content: bytes, media_type: str, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", media_type.encode()), (b"content-length", str(len(content)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": content})


async def _error(send, status: int, message: str, code: str) -> None:
    content = msgspec.json.encode(error_body(status, message, code=code))
    await _respond(send, status, content, "application/json", [(b"retry-after", b"1")] if status == 503 else [])


def application(config: ServerConfig, tenants: Path, data: Path) -> serve.Application:
    """The two deployments bound together, with the replica settings of `config`."""
    r = config.replicas
    if r.max > 1 and (not config.ledger.startswith("postgres") or not config.limits.startswith(("redis", "rediss"))):
        raise ConfigError("more than one replica needs the shared ledger and limits (ledger = \"postgresql://...\", "
                          "limits = \"redis://...\"): otherwise each replica would hold its own spend caps and rate "
                          "limits (docs/scale.md)")
    scaling = {"num_replicas": r.min} if r.min == r.max else \
        {"autoscaling_config": {"min_replicas": r.min, "max_replicas": r.max,
                                "target_ongoing_requests": r.target_ongoing}}
    replica = serve.deployment(SluiceReplica, name=REPLICA, **scaling,
                               max_ongoing_requests=config.max_inflight + config.max_queued,
                               ray_actor_options={"num_gpus": r.gpus} if r.gpus else {"num_cpus": r.cpus},
                               request_router_config=RequestRouterConfig(
                                   request_router_class="gateway.scale.serve_router:AffinityRouter",
                                   request_router_kwargs={"policy": r.routing, "slack": r.affinity_slack}),
                               health_check_period_s=5,
                               # A replica being replaced gets no new requests and may finish what
                               # it holds for the drain timeout, as `sluice serve` does on SIGTERM.
                               graceful_shutdown_timeout_s=config.drain_timeout_s,
                               graceful_shutdown_wait_loop_s=0.5)
    ingress = serve.deployment(serve.ingress()(SluiceIngress), name=INGRESS, num_replicas=r.ingress_replicas,
                               max_ongoing_requests=4 * (config.max_inflight + config.max_queued) * r.max,
                               ray_actor_options={"num_cpus": 0})
    where = (str(tenants.resolve()), str(data.resolve()))
    return ingress.bind(replica.bind(config, *where), config, *where)


def build(args: dict[str, str]) -> serve.Application:
    """Serve's application builder (`serve run deploy/serve.yaml`): args `tenants` and `data`
    (folders every node sees), `config` (the server TOML; built-in defaults without it)."""
    from gateway.config import load_server_config
    return application(load_server_config(args.get("config")), Path(args["tenants"]), Path(args["data"]))


def run(config: ServerConfig, tenants: Path, data: Path, host: str, port: int) -> None:
    """`sluice serve --ray`: join the Ray cluster RAY_ADDRESS names, or start one on this machine."""
    app = application(config, tenants, data)      # a config that cannot work fails before Ray starts
    ray.init()
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="sluice", route_prefix="/", blocking=True)
