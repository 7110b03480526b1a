"""The HTTP face of the gateway: a Litestar app over `Gateway` (service.py).

Handlers only translate: a request body into a `Query`, the pipeline's events into JSON, or
into Server-Sent Events. A streamed request takes the pipeline's first event (`Meta`)
before it answers, so every refusal (limits, budgets, a missing collection) still gets its
own status code rather than an error inside a 200 stream. (Should the response then never
start, the pipeline's generator is closed when collected, by asyncio's async-generator
finalizer, and gives back its engine slot and reservations.) A client that goes away
cancels its generation: the engine aborts it and frees its KV blocks at once. Bodies are
decoded by `JSONRequest`, strictly, into the handler's struct.
"""
from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any, TypeVar

import anyio
import msgspec
from litestar import Litestar, Request, Response, Router, delete, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import FromPath, JSONBody, Parameter
from litestar.response import Stream
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import HANDLERS, GatewayError, body, clause, documented, explain, on_openai_error
from gateway.http import schemas as s
from gateway.http.admin import admin_summary
from gateway.http.auth import authenticate, current_tenant
from gateway.http.dashboard import dashboard
from gateway.http.files import upload_route
from gateway.http.openapi import ASK_EVENTS, CHAT_EVENTS, make_truthful
from gateway.metrics import CONTENT_TYPE
from gateway.service import Done, Gateway, Meta, Token
from gateway.tenants import Tenant
from pipeline import Query
from retrieval import RetrievalError, parse

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Path and query parameters, checked by Litestar (a 422 naming the parameter) and documented.
CollectionPath = Annotated[str, Parameter(pattern=s.COLLECTION_NAME, description=s.COLLECTION_NAME_RULE)]
Month = Annotated[str | None, Parameter(pattern=s.MONTH, description="YYYY-MM")]


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def _json_number(text: str) -> int | float:
    """A JSON number written with a point or an exponent. 253.0 is an integer to JSON Schema
    (and to a client whose arithmetic is in floats), so it becomes one; a string never does."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return int(value) if value.is_integer() else value


JSON = msgspec.json.Decoder(float_hook=_json_number)
# A \u escape of half a UTF-16 surrogate pair without its other half (after an even run of
# backslashes: an escaped backslash before "u" is text). It stands for no character, so msgspec
# refuses it, in words that do not say so ("Input data was truncated" for a high half).
LONE_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                            rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2})")


class JSONRequest(Request):
    """Decodes a body into its handler's struct with msgspec, strictly: "8" is not an int and
    "true" not a bool (Litestar's own decoding would coerce them). Whatever is not a JSON
    object at all (another media type, bytes that are not UTF-8, nesting past the parser's
    depth) is a 4xx that says so, never a 500. A missing Content-Type is taken for JSON."""

    async def json(self) -> Any:
        media_type = self.content_type[0]
        if media_type and media_type != "application/json" and not media_type.endswith("+json"):
            raise GatewayError(415, f"the request body must be application/json, not {media_type!r}",
                               code="unsupported_media_type")
        raw = await self.body()
        try:     # (Litestar answers an empty body itself, as a missing `data`: see errors.py)
            value = JSON.decode(raw)
        except UnicodeDecodeError:
            raise GatewayError(400, "the request body is not valid UTF-8, which JSON must be",
                               code="invalid_utf8") from None
        except RecursionError:
            raise GatewayError(400, "the request body nests too deeply to parse", code="too_deep") from None
        except msgspec.DecodeError as e:      # malformed, or a number past a float's range
            lone = LONE_SURROGATE.search(raw)
            what = (f"{lone[1].decode()} is half of a UTF-16 surrogate pair without the other half, which is no "
                    f"character" if lone else
                    clause(str(e).removeprefix("JSON is malformed: ").replace(" - at `$[...]`", "")))
            raise GatewayError(400, f"the request body is not valid JSON: {what}", code="invalid_json") from None
        try:       # values typed Any (document metadata) are taken as decoded: no deeper recursion
            return msgspec.convert(value, self.route_handler.parsed_data_field.annotation, strict=True)
        except msgspec.ValidationError as e:
            field, message = explain(e)
            if field is None:                   # the body itself is not an object
                raise GatewayError(400, f"the request body must be a JSON object: {message}",
                                   code="invalid_body") from None
            raise GatewayError(422, message, field, "invalid_field") from None


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first. (A streamed response
    gets the same from Litestar, which watches for the disconnect while it streams.)"""
    result, error, finished = None, None, False
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result, finished = await work, True
        except Exception as e:          # raised after the group, not wrapped in an ExceptionGroup
            error = e
        group.cancel_scope.cancel()
    if error is not None:
        raise error
    if not finished:
        raise GatewayError(499, "the client closed the connection; its generation was cancelled")
    return result


def sse(data: msgspec.Struct | dict | str, event: str | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else msgspec.json.encode(data)
    return (f"event: {event}\n".encode() if event else b"") + b"data: " + payload + b"\n\n"


class EventStream(Stream):
    """A stream of Server-Sent Events. (Litestar would let the handler's JSON media type,
    taken from its return annotation, win over the stream's own.)"""

    def to_asgi_response(self, app, request, **kwargs):
        return super().to_asgi_response(app, request, **{**kwargs, "media_type": "text/event-stream"})


def sse_response(events: AsyncIterator[bytes], request_id: str) -> EventStream:
    return EventStream(events, headers={**SSE_HEADERS, "X-Request-Id": request_id})


async def _relay(first: bytes, events: AsyncIterator, render, on_error) -> AsyncIterator[bytes]:
    """SSE frames: `first`, then each pipeline event rendered. However this generator ends
    (finished, an error, or closed because the client went away) it closes the pipeline,
    shielded since the surrounding scope may be cancelled already: that aborts the
    generation and frees its KV blocks."""
    try:
        yield first
        async for event in events:
            yield render(event)
    except GatewayError as e:
        yield on_error(e)
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()


# ---------------------------------------------------------------------------- /v1/ask

def _ask_done(meta: Meta, done: Done) -> s.AskResponse:
    d = meta.decision
    return s.AskResponse(done.request_id, done.answer, meta.citations, done.cited, d.model, d.escalated,
                         d.difficulty, d.confidence, d.reason, done.usage, done.cost, done.timings, meta.trimmed,
                         done.finish_reason, d.arm, meta.cache, meta.cache_age_s)


@post("/ask", status_code=200, summary="Answer a question, from a collection or not", opt={"sse": ASK_EVENTS},
      responses=documented(400, 401, 402, 403, 404, 413, 415, 422, 429, 500, 503, 504),
      description="With `stream: true` the answer comes as Server-Sent Events: `meta` (route, citations), "
                  "`token` events (`{\"text\": ...}`), then `done` (usage, cost, timings), or `error`.")
async def ask(request: Request, data: JSONBody[s.AskRequest], tenant: NamedDependency[Tenant]) -> s.AskResponse:
    query = Query(question=data.question, endpoint="ask", collection=data.collection, mode=data.mode,
                  max_output_tokens=data.max_output_tokens, temperature=data.temperature, top_p=data.top_p,
                  seed=data.seed, requested_thinking=data.thinking_budget)
    gateway = gateway_of(request)
    if not data.stream:
        return _ask_done(*await until_disconnect(request, gateway.ask(tenant, query)))
    events = gateway.run(tenant, query)
    meta = await anext(events)      # refusals raise here, before the 200 is sent

    def render(event) -> bytes:
        if isinstance(event, Token):
            return sse(s.TokenEvent(event.text), "token")
        return sse(s.DoneEvent(event.request_id, event.usage, event.cost, event.timings, event.finish_reason,
                               event.cited), "done")

    first = sse(s.MetaEvent(meta.request_id, meta.route, meta.citations, meta.trimmed, meta.cache, meta.cache_age_s),
                "meta")
    error = lambda e: sse(body(e.status, e.message, e.param, e.code), "error")
    return sse_response(_relay(first, events, render, error), meta.request_id)


# ------------------------------------------------------------- /v1/chat/completions

def _text(content: str | list[s.TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _chat_usage(done: Done) -> s.ChatUsage:
    r, u = done.returned, done.usage
    return s.ChatUsage(r.prompt, r.completion, r.prompt + r.completion, s.PromptTokensDetails(r.cached),
                       s.CompletionTokensDetails(r.thinking),
                       s.BilledUsage(u.prompt, u.cached, u.completion, u.thinking))


@post("/chat/completions", status_code=200, summary="OpenAI-compatible chat completions",
      opt={"sse": CHAT_EVENTS},
      responses=documented(400, 401, 403, 404, 413, 415, 429, 500, 503, 504, openai=True),
      exception_handlers={GatewayError: on_openai_error},
      description="`model` is `auto`, `small` or `large`. Sluice's extra field `collection` answers from "
                  "that collection's passages (with an OpenAI SDK: `extra_body={\"collection\": ...}`). "
                  "An invalid request is a 400, as on OpenAI's API. `usage` counts the call whose completion "
                  "is returned; `usage.sluice_billed`, every call the request made.")
async def chat(request: Request, data: JSONBody[s.ChatRequest], tenant: NamedDependency[Tenant]) -> s.ChatCompletion:
    served = ("auto", *gateway_of(request).config.engine.models)
    if data.model not in served:
        raise GatewayError(404, f"model {data.model!r} does not exist; use one of {', '.join(served)}", "model",
                           "model_not_found")
    messages = [{"role": m.role, "content": _text(m.content)} for m in data.messages]
    questions = [m["content"] for m in messages if m["role"] == "user"]
    if not questions:
        raise GatewayError(422, "messages need at least one message with role 'user'", "messages", "no_user_message")
    stop = [data.stop] if isinstance(data.stop, str) else (data.stop or [])
    query = Query(question=questions[-1], endpoint="chat", messages=messages, collection=data.collection,
                  mode=data.model, mode_field="model", max_output_tokens=data.max_completion_tokens or data.max_tokens,
                  temperature=0.0 if data.temperature is None else data.temperature,
                  top_p=1.0 if data.top_p is None else data.top_p, seed=data.seed, stop=stop)
    gateway, created = gateway_of(request), int(time.time())
    if not data.stream:
        meta, done = await until_disconnect(request, gateway.ask(tenant, query))
        info = s.SluiceInfo(meta.route, meta.citations, meta.trimmed, done.cost, done.timings, meta.cache,
                            meta.cache_age_s, done.evicted)
        return s.ChatCompletion(f"chatcmpl-{done.request_id}", "chat.completion", created, meta.decision.model,
                                [s.Choice(0, s.AssistantMessage(done.answer), done.finish_reason)],
                                _chat_usage(done), info)
    events = gateway.run(tenant, query)
    meta = await anext(events)
    cid, model = f"chatcmpl-{meta.request_id}", meta.decision.model
    include_usage = bool(data.stream_options and data.stream_options.include_usage)

    def chunk(delta: s.Delta, finish: str | None = None, **extra) -> bytes:
        return sse(s.ChatCompletionChunk(cid, "chat.completion.chunk", created, model,
                                         [s.ChunkChoice(0, delta, finish)], **extra))

    def render(event) -> bytes:
        if isinstance(event, Token):
            return chunk(s.Delta(content=event.text))
        info = s.SluiceInfo(meta.route, meta.citations, meta.trimmed, event.cost, event.timings, meta.cache,
                            meta.cache_age_s, event.evicted)
        frames = chunk(s.Delta(), event.finish_reason, sluice=info)
        if include_usage:     # OpenAI's usage chunk: no choices, then [DONE]
            frames += sse(s.ChatCompletionChunk(cid, "chat.completion.chunk", created, model, [],
                                                usage=_chat_usage(event)))
        return frames + sse("[DONE]")

    first = chunk(s.Delta(role="assistant", content=""))
    error = lambda e: sse(body(e.status, e.message, e.param, e.code))     # OpenAI's in-stream error
    return sse_response(_relay(first, events, render, error), meta.request_id)


@get("/models", summary="Models this tenant may ask for (OpenAI-compatible list)",
     responses=documented(401, 429, 503))
async def models(tenant: NamedDependency[Tenant]) -> s.ModelList:
    return s.ModelList([s.ModelCard(m) for m in ("auto", *tenant.spec.allowed_models)])


# ------------------------------------------------------------------ collections

@post("/collections/{name:str}/documents", status_code=200,
      summary="Add or replace documents in one of the tenant's collections (created on first use)",
      responses=documented(400, 401, 413, 415, 422, 429, 503))
async def add_documents(request: Request, name: CollectionPath, data: JSONBody[s.IngestRequest],
                        tenant: NamedDependency[Tenant]) -> s.IngestResponse:
    docs = []
    for i, d in enumerate(data.documents):
        try:
            docs += parse(d.text, d.format, doc_id=d.id, title=d.title, metadata=d.metadata)
        except RetrievalError as e:
            raise GatewayError(422, f"documents[{i}]: {e}", f"documents[{i}]", "bad_document") from None
    return await gateway_of(request).ingest(tenant, name, docs)


@delete("/collections/{name:str}/documents/{doc_id:path}", status_code=200, summary="Delete one document",
        responses=documented(401, 404, 422, 429, 503))
async def delete_document(request: Request, name: CollectionPath, doc_id: FromPath[str],
                          tenant: NamedDependency[Tenant]) -> s.DeleteResponse:
    return await gateway_of(request).delete(tenant, name, doc_id.lstrip("/"))


@get("/collections", summary="The tenant's own collections", responses=documented(401, 429, 503))
async def list_collections(request: Request, tenant: NamedDependency[Tenant]) -> s.CollectionList:
    return await anyio.to_thread.run_sync(gateway_of(request).collections, tenant)


@get("/usage", summary="The calling tenant's usage and spend in one month (default: this one, UTC)",
     responses=documented(401, 422, 429, 503))
async def usage(request: Request, tenant: NamedDependency[Tenant], month: Month = None) -> s.UsageReport:
    return gateway_of(request).usage(tenant, month)


# ------------------------------------------------------------ public endpoints

@get("/healthz", summary="The process is up")
async def healthz() -> s.Health:
    return s.Health("ok")


@get("/readyz", summary="Models and embedder are loaded",
     responses={503: ResponseSpec(s.Health, generate_examples=False,
                                  description="still loading, loading failed (`detail` says why), or draining "
                                              "before shutdown")})
async def readyz(request: Request) -> Response[s.Health]:
    gw = gateway_of(request)
    if gw.draining:
        return Response(s.Health("draining", "shutting down"), status_code=503, headers={"Retry-After": "1"})
    if gw.ready:
        return Response(s.Health("ready", models=sorted(gw.engine.workers)))
    status = "failed" if gw.load_error else "loading"
    return Response(s.Health(status, gw.load_error), status_code=503, headers={"Retry-After": "5"})


@get("/metrics", summary="Prometheus metrics", media_type=CONTENT_TYPE)
async def metrics(request: Request) -> str:
    return gateway_of(request).metrics.render()


# ------------------------------------------------------------------ the app

def metrics_middleware(app: ASGIApp) -> ASGIApp:
    """Counts every routed HTTP request by route template, status and tenant, and times it."""
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        start, status = time.monotonic(), [500]

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, capture)
        finally:
            tenant = (scope.get("state") or {}).get("tenant")
            m = scope["app"].state.gateway.metrics
            route = scope.get("path_template", "")
            m.http.inc(route, str(status[0]), tenant.id if tenant else "")
            m.http_latency.observe(time.monotonic() - start, route)
    return middleware


def create_app(gateway: Gateway, banner: str | None = None, debug: bool = False) -> Litestar:
    """`banner` is printed once the models are loaded (`sluice serve --demo` prints its curl)."""
    v1 = Router("/v1", route_handlers=[ask, chat, models, add_documents, upload_route(gateway.config.max_upload_bytes),
                                       delete_document, list_collections, usage],
                guards=[authenticate], dependencies={"tenant": Provide(current_tenant, sync_to_thread=False)},
                security=[{"bearer": []}], request_class=JSONRequest)
    openapi = OpenAPIConfig(title="Sluice", version="0.1.0", path="/schema",
                            description="A workload-aware RAG gateway. Authenticate with "
                                        "`Authorization: Bearer <key>`.",
                            components=Components(security_schemes={"bearer": SecurityScheme(
                                type="http", scheme="bearer", description="the tenant's API key"),
                                "operator": SecurityScheme(type="http", scheme="bearer",
                                                           description="an operator key (the server config's "
                                                                       "operator_key_sha256), never a tenant's")}))
    pending: set[asyncio.Task] = set()      # a task must be referenced until it is done

    async def start() -> None:
        await gateway.start()
        if banner:
            task = asyncio.create_task(announce())
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def announce() -> None:
        try:
            await gateway.wait_ready()
        except RuntimeError:            # logged by the gateway; /readyz says why
            return
        print(banner, flush=True)

    operator = [admin_summary, dashboard]      # the operator's view (admin.py, dashboard.py)
    app = Litestar([v1, healthz, readyz, metrics, *operator], on_startup=[start], on_shutdown=[gateway.stop],
                   exception_handlers=HANDLERS, openapi_config=openapi, middleware=[metrics_middleware],
                   request_max_body_size=gateway.config.max_body_bytes, state=State({"gateway": gateway}),
                   debug=debug)
    make_truthful(app, gateway.config.engine.models, gateway.config.max_input_chars)
    return app
