"""The gateway's core, without HTTP: the components (tenants, limits, ledger, metrics,
engine, collections) and the ask pipeline that /v1/ask, /v1/chat/completions and
`sluice ask` all go through:

    refuse early (budgets, mode, limits) -> retrieve -> route -> trim to the context budget
    -> reserve tokens and spend -> wait for an engine slot -> generate -> ledger row -> done

`Gateway.run` is an async generator of events: `Meta` once the request holds a slot, a
`Token` per text delta, and `Done` after its ledger row is committed. A question the tenant's
answer cache holds (pipeline/answer_cache.py) skips the engine: its own ledger row (no
tokens; the tenant's hit price), then `Meta`, the stored answer as one `Token`, and `Done`. Everything that
refuses a request raises GatewayError before `Meta`, so an HTTP handler that takes the
first event before it answers can still reply with the right status.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec

from engine import AsyncEngine, EngineFailure, LLMEngine, Stopped
from gateway.config import ServerConfig
from gateway.errors import GatewayError, retry_after
from gateway.http import schemas as s
from gateway.metrics import GatewayMetrics
from gateway.tenants import Tenant, TenantRegistry
from gateway.usage.ledger import LedgerUnavailable
from gateway.usage.limits import Admission, month_of
from gateway.usage.rows import CACHE_HIT, UsageRow
from gateway.usage.storage import open_storage
from pipeline import Answer, DeadlineExceeded, Judged, Models, Pipeline, Plan, Progress, Query, Refused, cost, drive
from pipeline.answer_cache import AnswerCache, Hit, Lookup
from pipeline.answer_store import MemoryStore, RedisStore
from retrieval import BadFile, CollectionStore, Embedder, File, RetrievalError, read_changed
from router.data import RouterError
from router.model import RouterModel
from router.policy import Route

log = logging.getLogger("sluice.gateway")


@contextmanager
def refusals():
    """The pipeline's refusals as the gateway's errors."""
    try:
        yield
    except Refused as e:
        raise GatewayError(e.status, e.message, e.param, e.code) from None


@dataclass
class Meta:
    request_id: str
    decision: Route
    citations: list[s.Citation]
    trimmed: s.Trimmed
    cache: str | None = None                # hit | miss; None: the tenant's answer cache is off
    cache_age_s: float | None = None        # of the answer a hit served

    @property
    def route(self) -> s.RouteSummary:
        d = self.decision
        return s.RouteSummary(d.model, d.reason, d.difficulty, d.confidence, d.escalated, d.arm)


@dataclass
class Token:
    text: str


@dataclass
class Done:
    request_id: str
    answer: str
    usage: s.Usage                          # of every engine call the request made: what is billed
    returned: s.Usage                       # of the call whose completion is the answer
    cost: float
    timings: s.Timings
    finish_reason: str
    cited: list[int]
    evicted: int | None = None              # tokens a KV window dropped (None: no window)


@dataclass
class Job:
    """A planned request with what the ledger needs beside its answer."""
    tenant: Tenant
    query: Query
    answer: Answer
    start: float
    retrieval_s: float
    engine_start: float = 0.0               # when it got its engine slot
    lookup: Lookup | None = None            # where the answer cache files its answer; None: not cached

    @property
    def plan(self) -> Plan:
        return self.answer.plan

    def meta(self) -> Meta:
        """The route so far, and the context of the answer that stands (an escalation that
        widened the context cites the wider one)."""
        ctx = self.plan.context
        citations = [s.Citation(c.number, c.hit.chunk.id, c.hit.chunk.doc_id, c.hit.chunk.title, c.hit.score,
                                c.hit.chunk.page, c.hit.chunk.page_end, c.hit.chunk.section or None)
                     for c in ctx.citations]
        trimmed = s.Trimmed(len(ctx.trimmed.chunks), len(ctx.trimmed.dropped), ctx.trimmed.tokens, ctx.trimmed.budget)
        return Meta(self.plan.request_id, self.answer.route, citations, trimmed, "miss" if self.lookup else None)


@dataclass
class Served:
    """A request the answer cache answers."""
    tenant: Tenant
    query: Query
    hit: Hit
    request_id: str
    start: float
    retrieval_s: float

    def meta(self) -> Meta:
        e, how = self.hit.entry, ("a near duplicate" if self.hit.match == "near" else "the same question")
        similarity = f", similarity {self.hit.similarity}" if self.hit.similarity is not None else ""
        route = Route(e.model, f"answered from the answer cache: {how} (age {self.hit.age_s:.1f} s{similarity}), "
                               f"first answered as {e.request_id}: {e.reason}", e.difficulty, confidence=e.confidence,
                      escalated=e.escalated, arm=e.arm, source="cache")
        citations = [s.Citation(c.number, c.chunk_id, c.doc_id, c.title, c.score) for c in e.citations]
        return Meta(self.request_id, route, citations, s.Trimmed(*e.trimmed), "hit", round(self.hit.age_s, 3))


def answer_cache_for(config: ServerConfig) -> AnswerCache:
    """The server's answer cache, in the store its config names, for answers of its models."""
    where = config.answer_cache
    if where == "limits":
        where = "memory" if config.limits == "memory" else config.limits
    store = MemoryStore(config.answer_cache_bytes) if where == "memory" else RedisStore(where)
    router = config.router.path if config.router else None
    return AnswerCache(store, msgspec.json.encode([config.engine.models, router, config.retrieval_k]).decode())


def pipeline_for(config: ServerConfig, models: Models, embedder) -> Pipeline:
    """The server's pipeline over `models` (its engine; the Ray ingress, the tokenizers alone)."""
    router, router_error = None, None
    if config.router is not None and config.router.path:
        try:
            router = RouterModel.load(config.router.path)
        except RouterError as e:         # serve anyway: every auto request says it fell back
            router_error = str(e)
            log.error("router not loaded, mode=auto uses tenant defaults: %s", e)
    # The cascade's pair: the cheapest and the dearest model by output price.
    by_price = sorted(config.engine.models, key=lambda m: config.prices[m].output)
    pair = (by_price[0], by_price[-1]) if config.router is not None else None
    return Pipeline(models, config.prices, router, router_error, embedder, pair, config.retrieval_k,
                    config.max_input_chars, answer_cache_for(config))


class Gateway:
    def __init__(self, config: ServerConfig, tenants: TenantRegistry, data_dir: str | Path,
                 engine: LLMEngine | None = None, embedder=None):
        """`engine` and `embedder` are loaded by `start()` when not given (tests share theirs)."""
        self.config = config
        self.tenants = tenants
        self.data_dir = Path(data_dir)
        self.ledger, self.rates, self.spend = open_storage(config, self.data_dir)
        self.admission = Admission(config.max_inflight, config.max_queued)
        self.metrics = GatewayMetrics(
            lambda: self.engine.stats() if self.engine else {},
            lambda: (self.admission.running, self.admission.waiting),
            lambda: (len(tenants.tenants), tenants.errors, tenants.reloads))
        self.metrics.ledger_state = lambda: (self.ledger.folded, self.ledger.fold_failures)
        self.engine = engine
        self.embedder = embedder
        self.async_engine: AsyncEngine | None = None     # the background loop stepping `engine`
        self.pipeline: Pipeline | None = None
        self.collection_store: CollectionStore | None = None
        self.load_error: str | None = None
        self.draining = False            # refusing new requests: shutting down (drain)
        self.closed = False              # past the drain: nothing more is started
        self._loading: asyncio.Task | None = None
        self._ingest = anyio.CapacityLimiter(1)    # embedding is CPU-bound: one ingest at a time

    # ---- life cycle ----

    @property
    def ready(self) -> bool:
        return self.async_engine is not None and self.collection_store is not None

    async def start(self) -> None:
        """Returns at once; models load in a thread while /healthz answers and /readyz says so."""
        self._loading = asyncio.create_task(self._load())

    async def wait_ready(self) -> None:
        if self._loading:
            await self._loading
        if self.load_error:
            raise RuntimeError(self.load_error)

    async def _load(self) -> None:
        try:
            await anyio.to_thread.run_sync(self._load_blocking)
        except Exception as e:              # reported by /readyz and every request
            log.exception("loading failed")
            self.load_error = f"loading failed: {type(e).__name__}: {e}"
            return
        self.async_engine = AsyncEngine(self.engine)
        await self.async_engine.start()
        log.info("ready: serving %s", ", ".join(self.engine.workers))
        log.info(self.engine.memory_plan())

    def _load_blocking(self) -> None:
        config = self.config
        if self.engine is None:
            self.engine = LLMEngine(config.engine)
        if self.embedder is None:
            self.embedder = Embedder()
        self.collection_store = CollectionStore(self.data_dir / "collections", self.embedder)
        self.pipeline = pipeline_for(config, self.engine, self.embedder)
        cache = self.pipeline.cache
        self.metrics.answer_cache_state = lambda: (cache.stats(), cache.errors)

    async def stop(self) -> None:
        if self._loading:
            self._loading.cancel()
        if self.async_engine:
            await self.async_engine.stop()
        if self.collection_store:
            self.collection_store.close()
        self.ledger.close()

    async def drain(self) -> None:
        """Stop admitting (503), let what was admitted finish for up to drain_timeout_s, then
        cut the rest with a clear error and return once their ledger rows are written."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        while (self.admission.running or self.admission.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.closed = True
        if self.async_engine:
            await self.async_engine.fail_all(Stopped("the server is shutting down"))
        while self.admission.running or self.admission.waiting:     # the cut ones settle, the queued leave
            await asyncio.sleep(0.01)
        log.info("drained")

    def _require_ready(self) -> None:
        if self.draining:
            raise retry_after(503, "the server is shutting down; retry shortly (another replica may answer)", 1,
                              "shutting_down")
        if self.load_error:
            raise GatewayError(503, f"the server cannot answer: {self.load_error}", code="not_ready")
        if not self.ready:
            raise retry_after(503, "models are still loading; retry shortly", 5, "not_ready")

    # ---- the ask pipeline ----

    async def run(self, tenant: Tenant, query: Query) -> AsyncIterator[Meta | Token | Done]:
        job = await self._plan(tenant, query)
        if isinstance(job, Served):
            async for event in self._serve(job):
                yield event
            return
        answer = job.answer
        est_tokens, est_cost = self.pipeline.estimate(job.plan)
        self.rates.take_tokens(tenant, est_tokens)
        try:
            self.spend.reserve(tenant, est_cost)
        except GatewayError:
            self.rates.settle_tokens(tenant, est_tokens, 0)
            raise
        progress = Progress()
        held = True

        def release():           # once: after the ledger row, or on any way out
            nonlocal held
            if held:
                held = False
                self.spend.release(tenant, est_cost)
                prompts = sum(len(c.prompt_token_ids) for c in answer.calls) + \
                    (len(progress.call.prompt_ids) if progress.call else 0)
                self.rates.settle_tokens(tenant, est_tokens, prompts + progress.tokens)

        limit = tenant.spec.limits.request_timeout_s or self.config.request_timeout_s
        deadline = job.start + limit
        try:
            async with self.admission.slot(deadline) as queued:
                if self.closed:                    # queued through the whole drain: nothing ran
                    raise retry_after(503, "the server is shutting down; retry shortly", 1, "shutting_down")
                # While the answer may yet be escalated, Meta (with the final route) waits for
                # the cascade's verdict, and the driver holds the text back with it.
                if not answer.may_escalate:
                    yield job.meta()
                job.engine_start = time.monotonic()
                try:
                    async with aclosing(drive(answer, self.async_engine, progress, deadline)) as events:
                        async for event in events:
                            yield job.meta() if isinstance(event, Judged) else Token(event.text)
                except ValueError as e:            # the engine refused the input: nothing ran
                    raise GatewayError(422, f"the engine refused this request: {e}", code="engine_refused") from e
                except DeadlineExceeded:           # its blocks are free already
                    with anyio.CancelScope(shield=True):
                        await self._settle(job, progress, queued, "timeout")
                    raise GatewayError(504, f"the request passed its deadline of {limit:g} s and was cut after "
                                            f"{progress.tokens} generated tokens, which are billed",
                                       code="deadline_exceeded") from None
                except Stopped:                    # cut by the drain's end
                    with anyio.CancelScope(shield=True):
                        await self._settle(job, progress, queued, "cancelled")
                    raise retry_after(503, f"the server is shutting down and cut this request after "
                                           f"{progress.tokens} generated tokens, which are billed; retry",
                                      1, "shutting_down") from None
                except EngineFailure as e:
                    with anyio.CancelScope(shield=True):
                        await self._settle(job, progress, queued, "error")
                    raise GatewayError(500, f"the engine failed while generating: {e}", code="engine_failed") from e
                except BaseException:              # cancelled or closed: the client went away
                    with anyio.CancelScope(shield=True):
                        await self._settle(job, progress, queued, "cancelled")
                    raise
            done = await self._settle(job, progress, queued, "ok")
            release()
            yield done
        finally:
            release()

    async def _plan(self, tenant: Tenant, q: Query) -> Job | Served:
        """The pipeline's plan, with the gateway's own refusals (limits, a missing collection)
        where they cost least: after the pipeline's cheap checks, before retrieval; or the
        answer cache's hit (an exact one before retrieval, a near duplicate after it)."""
        start = time.monotonic()
        self._require_ready()
        if self.ledger.unavailable:
            raise retry_after(503, f"the usage ledger takes no writes now ({self.ledger.unavailable}); no request is "
                                   f"answered unbilled, so none is taken until it does", 1, "ledger_unavailable")
        terms = tenant.terms
        with refusals():
            self.pipeline.check(terms, q)
        wait = self.rates.tokens_empty(tenant)
        if wait:
            raise retry_after(429, f"tenant {tenant.id!r} has used its tokens per minute; retry in {wait:.1f} s",
                              wait, "rate_limit_tokens")
        self.spend.check_open(tenant)
        collection = None
        if q.collection is not None:
            try:
                collection = self.collection_store.collection(tenant.id, q.collection, create=False)
            except RetrievalError:       # another tenant's collection is as absent as a missing one
                raise GatewayError(404, f"collection {q.collection!r} not found", "collection",
                                   "collection_not_found") from None
        t = time.monotonic()
        request_id = f"req_{uuid.uuid4().hex[:24]}"
        lookup, plan = self.pipeline.lookup(terms, q, collection)      # plan: an exact hit, or None
        if plan is None:
            with refusals():
                if q.collection is None and not self.pipeline.routes_by_classifier(terms, q):
                    plan = self.pipeline.plan(terms, q, None, request_id, lookup)    # counting tokens: quick
                else:                    # embedding, searching, counting passages, classifying: CPU
                    plan = await anyio.to_thread.run_sync(self.pipeline.plan, terms, q, collection, request_id,
                                                          lookup)
        if lookup is not None:
            result = "miss" if not isinstance(plan, Hit) else "hit" if plan.match == "exact" else "near_hit"
            self.metrics.answer_cache.inc(tenant.id, result)
        if isinstance(plan, Hit):
            return Served(tenant, q, plan, request_id, start, time.monotonic() - t)
        return Job(tenant, q, self.pipeline.answer(plan), start, time.monotonic() - t, lookup=lookup)

    async def _serve(self, served: Served) -> AsyncIterator[Meta | Token | Done]:
        """A cached answer: billed first (its own ledger row: no tokens, the tenant's hit price),
        then sent as a fresh one is, in one piece."""
        tenant, e, price = served.tenant, served.hit.entry, served.tenant.terms.cache.hit_price
        meta = served.meta()
        if price:
            self.spend.reserve(tenant, price)
        try:
            total = round((time.monotonic() - served.start) * 1000, 3)
            timings = s.Timings(round(served.retrieval_s * 1000, 3), 0.0, total, 0.0, total)
            d = meta.decision
            try:
                await self.ledger.record(UsageRow(
                    served.request_id, time.time(), month_of(time.time()), tenant.id, served.query.endpoint, "ok",
                    e.model, CACHE_HIT, served.query.collection, 0, 0, 0, 0, price, timings.retrieval, 0.0,
                    timings.ttft, timings.total, d.reason, d.difficulty, d.confidence, d.escalated, e.finish_reason,
                    d.arm))
            except LedgerUnavailable as err:
                raise retry_after(503, f"the usage ledger takes no writes now ({err}); this request's answer is "
                                       f"withheld rather than given unbilled", 1, "ledger_unavailable") from None
        finally:
            if price:
                self.spend.release(tenant, price)
        m = self.metrics
        m.answers.inc(e.model, "cached")
        m.cost.inc(tenant.id, e.model, amount=price)
        m.answer_cache_saved.inc(tenant.id, amount=max(0.0, e.cost - price))
        m.latency.observe(time.monotonic() - served.start, "cache")
        yield meta
        yield Token(e.text)
        yield Done(served.request_id, e.text, s.Usage(0, 0, 0, 0), s.Usage(0, 0, 0, 0), price, timings,
                   e.finish_reason, e.cited)

    async def _settle(self, job: Job, p: Progress, queued: float, status: str) -> Done:
        """Write the ledger row (the request counts as answered only once it is committed)
        and the metrics."""
        answer, d = job.answer, job.answer.route
        # (model, prompt, cached, produced, thinking) per call: an escalated request pays for both.
        calls = [(c.model, len(c.prompt_token_ids), c.num_cached_tokens, c.num_billed_tokens, c.num_thinking_tokens)
                 for c in answer.calls]
        if p.call is not None:           # cut short: what it had produced so far
            calls.append((p.call.model, len(p.call.prompt_ids), p.cached,
                          p.tokens - sum(c[3] for c in calls), 0))
        prices = self.config.prices
        spent = 0.0 if status == "error" else sum(cost(prices[c[0]], *c[1:4]) for c in calls)
        prompt, cached, produced, thinking = (sum(c[i] for c in calls) for i in range(1, 5))
        now = time.monotonic()
        ms = lambda seconds: round(seconds * 1000, 3)
        timings = s.Timings(retrieval=ms(job.retrieval_s), queue=ms(queued),
                            ttft=ms(p.first_token - job.start) if p.first_token else None,
                            engine=ms(now - job.engine_start) if job.engine_start else 0.0, total=ms(now - job.start))
        last = answer.calls[-1] if answer.calls and p.call is None else None
        finish = last.finish_reason if last else "abort"
        text = last.text if last else p.text
        model, tenant_id = d.model, job.tenant.id
        try:
            await self.ledger.record(UsageRow(
                job.plan.request_id, time.time(), month_of(time.time()), tenant_id, job.query.endpoint, status,
                model, ",".join(c[0] for c in calls), job.query.collection, prompt, cached, produced, thinking, spent,
                timings.retrieval, timings.queue, timings.ttft, timings.total, d.reason, d.difficulty, d.confidence,
                d.escalated, finish, d.arm))
        except LedgerUnavailable as e:     # kept, and written when the store is back; not answered now
            raise retry_after(503, f"the usage ledger takes no writes now ({e}); this request's answer is withheld "
                                   f"rather than given unbilled", 1, "ledger_unavailable") from None
        if status == "ok" and self.pipeline.remember(job.lookup, answer):
            self.metrics.answer_cache_stored.inc(tenant_id)
        m = self.metrics
        m.answers.inc(model, status)
        m.escalations.inc(amount=int(d.escalated))
        m.early_escalations.inc(amount=int(answer.cut_early))
        m.widened.inc(amount=int(answer.widened))
        m.passages.inc(tenant_id, "selected" if job.plan.terms.selection else "whole",
                       amount=len(job.plan.context.citations))
        m.routes.inc(tenant_id, calls[0][0] if calls else job.plan.route.model, d.difficulty or "none", d.source)
        m.arms.inc(tenant_id, d.arm or model)         # as the ledger's rollup counts arms
        for name, *counts in calls:
            for kind, n in zip(("prompt", "cached", "completion"), counts[:3]):
                m.tokens.inc(tenant_id, name, kind, amount=n)
        m.tokens.inc(tenant_id, model, "thinking", amount=thinking)
        m.cost.inc(tenant_id, model, amount=spent)
        m.latency.observe(now - job.start, model)
        m.queue_wait.observe(queued, model)
        m.retrieval.observe(job.retrieval_s)
        if p.first_token:
            m.ttft.observe(p.first_token - job.start, model)
        evicted = None
        if job.plan.window is not None:
            evicted = last.num_evicted_tokens if last else 0
            m.evicted_tokens.inc(tenant_id, model, amount=sum(c.num_evicted_tokens for c in answer.calls))
        cited = job.plan.context.cited(text)
        returned = s.Usage(*calls[-1][1:]) if calls else s.Usage(0, 0, 0, 0)
        return Done(job.plan.request_id, text, s.Usage(prompt, cached, produced, thinking), returned, spent, timings,
                    finish, cited, evicted)

    async def ask(self, tenant: Tenant, query: Query) -> tuple[Meta, Done]:
        """The whole answer at once."""
        meta = done = None
        async for event in self.run(tenant, query):
            if isinstance(event, Meta):
                meta = event
            elif isinstance(event, Done):
                done = event
        return meta, done

    # ---- collections and usage ----

    def _collection(self, tenant: Tenant, name: str, create: bool):
        self._require_ready()
        try:
            return self.collection_store.collection(tenant.id, name, create=create)
        except RetrievalError:
            raise GatewayError(404, f"collection {name!r} not found", "name", "collection_not_found") from None

    async def ingest(self, tenant: Tenant, name: str, documents: list, unchanged: list[str] = ()) -> s.IngestResponse:
        collection = self._collection(tenant, name, create=True)
        try:
            report = await anyio.to_thread.run_sync(lambda: collection.ingest(documents, unchanged=unchanged),
                                                    limiter=self._ingest)
        except RetrievalError as e:
            raise GatewayError(422, str(e), "documents", "bad_documents") from None
        for outcome in ("added", "replaced", "unchanged"):
            self.metrics.ingested.inc(tenant.id, outcome, amount=getattr(report, outcome))
        self.metrics.embedded.inc(tenant.id, amount=report.embedded)
        return s.IngestResponse(name, report.documents, report.chunks, report.removed, report.embedded,
                                report.added, report.replaced, report.unchanged)

    async def ingest_files(self, tenant: Tenant, name: str, files: list[File]) -> s.IngestResponse:
        """Files read as the CLI reads them; an unchanged one (same digest as stored) is not even
        parsed. Every file is read before the collection is touched (or created), so one bad file
        leaves it exactly as it was."""
        self._require_ready()
        try:
            stored = self.collection_store.collection(tenant.id, name, create=False).digests()
        except RetrievalError:
            stored = {}
        try:
            docs, unchanged = await anyio.to_thread.run_sync(
                read_changed, files, stored, tenant.spec.limits.max_file_bytes, limiter=self._ingest)
        except BadFile as e:
            # A file's type is no part of the request's shape: 422, as other refusals of its content.
            status = 413 if e.code == "too_large" else 422
            raise GatewayError(status, str(e), "files", f"file_{e.code}") from None
        except RetrievalError as e:
            raise GatewayError(422, str(e), "files", "bad_files") from None
        return await self.ingest(tenant, name, docs, unchanged)

    async def delete(self, tenant: Tenant, name: str, doc_id: str) -> s.DeleteResponse:
        collection = self._collection(tenant, name, create=False)
        removed = await anyio.to_thread.run_sync(collection.delete, doc_id, limiter=self._ingest)
        if not removed:
            raise GatewayError(404, f"collection {name!r} has no document {doc_id!r}", "doc_id", "document_not_found")
        return s.DeleteResponse(name, doc_id, removed)

    def collections(self, tenant: Tenant) -> s.CollectionList:
        self._require_ready()
        out = []
        for name in self.collection_store.names(tenant.id):
            c = self.collection_store.collection(tenant.id, name, create=False)
            out.append(s.CollectionInfo(name, len(c.doc_ids()), len(c)))
        return s.CollectionList(out)

    def usage(self, tenant: Tenant, month: str | None = None) -> s.UsageReport:
        month = month or month_of(time.time())
        by_model = {m: s.UsageTotals(**u) for m, u in self.ledger.usage(tenant.id, month).items()}
        totals = s.UsageTotals(*(sum(getattr(u, f) for u in by_model.values())
                                 for f in s.UsageTotals.__struct_fields__))
        cap = tenant.spec.limits.monthly_spend_cap_usd
        spent = self.ledger.spent(tenant.id, month)
        return s.UsageReport(tenant.id, month, totals, by_model, cap, max(0.0, cap - spent))
