"""The gateway's core, without HTTP: the components (tenants, limits, ledger, metrics,
engine, collections) and the ask pipeline that /v1/ask, /v1/chat/completions and
`sluice ask` all go through:

    refuse early (budgets, mode, limits) -> retrieve -> route -> trim to the context budget
    -> reserve tokens and spend -> wait for an engine slot -> generate -> ledger row -> done

`Gateway.run` is an async generator of events: `Meta` once the request holds a slot, a
`Token` per text delta, and `Done` after its ledger row is committed. Everything that
refuses a request raises GatewayError before `Meta`, so an HTTP handler that takes the
first event before it answers can still reply with the right status.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
import msgspec

from engine.async_engine import AsyncEngine, EngineFailure
from engine.llm_engine import Completion, LLMEngine
from engine.sampling_params import SamplingParams
from gateway import schemas as s
from gateway.config import Price, ServerConfig
from gateway.decision import Decision, decide
from gateway.errors import GatewayError, retry_after
from gateway.ledger import Ledger, UsageRow
from gateway.limits import Admission, RateLimiter, SpendGuard, month_of
from gateway.metrics import GatewayMetrics
from gateway.tenants import Tenant, TenantRegistry
from retrieval import Embedder, OverBudget, RetrievalError, CollectionStore, rag_context
from router import cascade
from router.confidence import ConfidenceModel
from router.data import RouterError
from router.model import RouterModel

log = logging.getLogger("sluice.gateway")
# Tokens budget forcing may add after a spent thinking budget (nudge and closing marker), for estimates.
THINKING_OVERHEAD = 48
CITE = re.compile(r"\[(\d+)\]")


@dataclass
class Query:
    """One question, however it arrived."""
    question: str                          # what retrieval searches for
    endpoint: str                          # ask | chat | cli, for the ledger
    messages: list[dict] | None = None     # a chat conversation; None: the question alone
    collection: str | None = None
    mode: str = "auto"
    mode_field: str = "mode"               # the request field that carried the mode
    max_output_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    thinking_budget: int = 0


@dataclass
class Meta:
    request_id: str
    decision: Decision
    citations: list[s.Citation]
    trimmed: s.Trimmed

    @property
    def route(self) -> s.Route:
        d = self.decision
        return s.Route(d.model, d.reason, d.difficulty, d.confidence, d.escalated)


@dataclass
class Token:
    text: str


@dataclass
class Done:
    request_id: str
    answer: str
    usage: s.Usage
    cost: float
    timings: s.Timings
    finish_reason: str
    cited: list[int]


@dataclass
class Plan:
    """A request after every check that needs no reservation."""
    request_id: str
    tenant: Tenant
    query: Query
    decision: Decision
    messages: list[dict]                   # for the escalation model's own prompt
    prompt_ids: list[int]
    params: SamplingParams
    citations: list[s.Citation]
    trimmed: s.Trimmed
    start: float
    retrieval_s: float


@dataclass
class Progress:
    """What the engine has produced so far, for the ledger even if the client goes away."""
    text: str = ""
    tokens: int = 0
    cached: int = 0
    first_token: float | None = None
    engine_start: float = 0.0
    completion: Completion | None = None    # the engine's last output carries it
    earlier: list[Completion] = field(default_factory=list)   # calls the cascade escalated past: billed too


def cost_of(price: Price, prompt: int, cached: int, completion: int) -> float:
    return ((prompt - cached) * price.input + cached * price.cached_input + completion * price.output) / 1e6


class Gateway:
    def __init__(self, config: ServerConfig, tenants: TenantRegistry, data_dir: str | Path,
                 engine: LLMEngine | None = None, embedder=None):
        """`engine` and `embedder` are loaded by `start()` when not given (tests share theirs)."""
        self.config = config
        self.tenants = tenants
        self.data_dir = Path(data_dir)
        self.ledger = Ledger(self.data_dir / "ledger.sqlite", config.ledger_synchronous)
        self.rates = RateLimiter()
        self.spend = SpendGuard(self.ledger)
        self.admission = Admission(config.max_inflight, config.max_queued)
        self.metrics = GatewayMetrics(
            lambda: self.llm.stats() if self.llm else {},
            lambda: (self.admission.running, self.admission.waiting),
            lambda: (len(tenants.tenants), tenants.errors, tenants.reloads))
        self.llm = engine
        self.embedder = embedder
        self.router: RouterModel | None = None
        self.router_error: str | None = None      # a router that failed to load: auto falls back, saying why
        # The cascade's pair: the cheapest and the dearest model by output price.
        by_price = sorted(config.engine.models, key=lambda m: config.prices[m].output)
        self.pair = (by_price[0], by_price[-1]) if config.router is not None else None
        self.engine: AsyncEngine | None = None
        self.store = None
        self.load_error: str | None = None
        self._loading: asyncio.Task | None = None
        self._ingest = anyio.CapacityLimiter(1)    # embedding is CPU-bound: one ingest at a time

    # ---- life cycle ----

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.store is not None

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
        self.engine = AsyncEngine(self.llm)
        await self.engine.start()
        log.info("ready: serving %s", ", ".join(self.llm.workers))

    def _load_blocking(self) -> None:
        if self.llm is None:
            self.llm = LLMEngine(self.config.engine)
        if self.embedder is None:
            self.embedder = Embedder()
        self.store = CollectionStore(self.data_dir / "collections", self.embedder)
        if self.config.router is not None and self.config.router.path:
            try:
                self.router = RouterModel.load(self.config.router.path)
            except RouterError as e:         # serve anyway: every auto request says it fell back
                self.router_error = str(e)
                log.error("router not loaded, mode=auto uses tenant defaults: %s", e)

    @property
    def confidence(self) -> ConfidenceModel:
        return self.router.confidence if self.router else ConfidenceModel()

    async def stop(self) -> None:
        if self._loading:
            self._loading.cancel()
        if self.engine:
            await self.engine.stop()
        if self.store:
            self.store.close()
        self.ledger.close()

    def _require_ready(self) -> None:
        if self.load_error:
            raise GatewayError(503, f"the server cannot answer: {self.load_error}", code="not_ready")
        if not self.ready:
            raise retry_after(503, "models are still loading; retry shortly", 5, "not_ready")

    # ---- the ask pipeline ----

    async def run(self, tenant: Tenant, query: Query) -> AsyncIterator[Meta | Token | Done]:
        plan = await self._plan(tenant, query)
        params = plan.params
        most_out = params.max_tokens + (params.thinking_budget or 0) + THINKING_OVERHEAD * bool(params.thinking_budget)
        calls = [m for m in (plan.decision.model, plan.decision.escalate_to) if m]   # at most, if it escalates
        est_tokens = (len(plan.prompt_ids) + most_out) * len(calls)
        est_cost = sum(cost_of(self.config.prices[m], len(plan.prompt_ids), 0, most_out) for m in calls)
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
                prompts = len(plan.prompt_ids) * (1 + len(progress.earlier))   # an escalation reads it again
                self.rates.settle_tokens(tenant, est_tokens, prompts + progress.tokens)

        try:
            async with self.admission.slot() as queued:
                # While the answer may yet be escalated, Meta (with the final route) and the
                # tokens wait for the cascade's verdict: a client never sees a replaced answer.
                holding = plan.decision.escalate_to is not None
                if not holding:
                    yield Meta(plan.request_id, plan.decision, plan.citations, plan.trimmed)
                try:
                    # aclosing: if our consumer closes us mid-answer, the engine's stream is
                    # closed now (aborting the request), not whenever it is garbage-collected.
                    progress.engine_start = time.monotonic()
                    d = plan.decision
                    verdict_of = lambda lp: cascade.judge(d.escalate_to, tenant.spec.escalation_threshold,
                                                          self.confidence, lp)
                    async with aclosing(cascade.run(self.engine, d.model, d.escalate_to, verdict_of,
                                                    lambda m: self._prompt_ids(plan, m), params, tenant.salt,
                                                    plan.request_id)) as events:
                        async for out in events:
                            if isinstance(out, cascade.Verdict):
                                self._verdict(plan, progress, out)
                                yield Meta(plan.request_id, plan.decision, plan.citations, plan.trimmed)
                                if not out.escalate and progress.text:
                                    yield Token(progress.text)
                                holding = False
                                continue
                            if progress.first_token is None:
                                progress.first_token = time.monotonic()
                                progress.cached = self._cached_so_far(out.request_id)
                            progress.tokens += len(out.new_token_ids)
                            progress.completion = out.completion
                            if out.text_delta:
                                progress.text += out.text_delta
                                if not holding:
                                    yield Token(out.text_delta)
                except ValueError as e:            # the engine refused the input: nothing ran
                    raise GatewayError(422, f"the engine refused this request: {e}", code="engine_refused") from e
                except EngineFailure as e:
                    with anyio.CancelScope(shield=True):
                        await self._settle(plan, progress, queued, "error")
                    raise GatewayError(500, f"the engine failed while generating: {e}", code="engine_failed") from e
                except BaseException:              # cancelled or closed: the client went away
                    with anyio.CancelScope(shield=True):
                        await self._settle(plan, progress, queued, "cancelled")
                    raise
            done = await self._settle(plan, progress, queued, "ok")
            release()
            yield done
        finally:
            release()

    def _verdict(self, plan: Plan, progress: Progress, verdict: cascade.Verdict) -> None:
        """The cascade's verdict into the route; an escalation starts a new call's progress."""
        d = plan.decision
        plan.decision = replace(d, reason=f"{d.reason}; {verdict.reason}", confidence=verdict.confidence,
                                escalated=verdict.escalate, model=d.escalate_to if verdict.escalate else d.model)
        if verdict.escalate:
            progress.earlier.append(progress.completion)
            progress.text, progress.completion = "", None

    def _prompt_ids(self, plan: Plan, model: str) -> list[int]:
        """The plan's messages in `model`'s own chat template (the first call's are in the plan)."""
        if model == plan.decision.model and not plan.decision.escalated:
            return plan.prompt_ids
        thinking = plan.params.thinking_budget is not None
        return self.llm.worker(model).tokenizer.encode(self.llm.chat_prompt(plan.messages, model, thinking=thinking))

    def _cached_so_far(self, request_id: str) -> int:
        """Prompt tokens the prefix cache served, for the ledger should the client leave
        before the completion (which has the final count) arrives. The engine forgets a
        request once it finishes, possibly before we read this: then the completion will say."""
        try:
            return self.llm.sequence(request_id).num_cached_tokens
        except KeyError:
            return 0

    async def _plan(self, tenant: Tenant, q: Query) -> Plan:
        start = time.monotonic()
        request_id = f"req_{uuid.uuid4().hex[:24]}"
        self._require_ready()
        most = max(msgspec.structs.astuple(tenant.spec.thinking_budget))
        if q.thinking_budget > most:
            raise GatewayError(422, f"thinking_budget is {q.thinking_budget}; tenant {tenant.id!r} allows at most "
                                    f"{most} thinking tokens", "thinking_budget", "over_thinking_budget")
        chars = len(q.question) if q.messages is None else sum(len(m["content"]) for m in q.messages)
        if chars > self.config.max_input_chars:
            what = "question" if q.messages is None else "messages"
            raise GatewayError(422, f"{what} has {chars} characters; the limit is {self.config.max_input_chars}",
                               what, "input_too_long")
        budget = tenant.spec.output_budget
        max_tokens = q.max_output_tokens or budget
        if max_tokens > budget:
            field_name = "max_output_tokens" if q.endpoint != "chat" else "max_tokens"
            raise GatewayError(422, f"{field_name} is {max_tokens}; tenant {tenant.id!r} allows at most {budget} "
                                    f"output tokens", field_name, "over_output_budget")
        # With the router installed an auto decision is provisional until retrieval has run:
        # its model's tokenizer trims the context (the cascade's pair shares one tokenizer).
        routed = q.mode == "auto" and self.pair is not None
        decision = replace(decide(tenant, q.mode, q.mode_field), thinking_budget=q.thinking_budget)
        # Refuse cheaply what the limits would refuse anyway, before retrieval does any work.
        wait = self.rates.tokens_empty(tenant)
        if wait:
            raise retry_after(429, f"tenant {tenant.id!r} has used its tokens per minute; retry in {wait:.1f} s",
                              wait, "rate_limit_tokens")
        self.spend.check_open(tenant)
        t = time.monotonic()
        tokenizer = self.llm.worker(decision.model).tokenizer
        embed = routed and tenant.spec.router.classifier and self.router is not None
        if q.collection is None and not embed:   # counting a question's tokens: too quick for a thread
            messages, citations, trimmed, scores, vector = self._prompt(tenant, q, tokenizer, embed)
        else:                            # embedding the query and counting passages take CPU
            messages, citations, trimmed, scores, vector = await anyio.to_thread.run_sync(
                self._prompt, tenant, q, tokenizer, embed)
        retrieval_s = time.monotonic() - t
        if routed:                       # the classifier runs under its time limit: off the event loop
            decision = await anyio.to_thread.run_sync(self._route, tenant, q, scores, vector)
        thinking = decision.thinking_budget > 0      # 0: answer at once, no span at all
        prompt_ids = self.llm.worker(decision.model).tokenizer.encode(
            self.llm.chat_prompt(messages, decision.model, thinking=thinking))
        limit = self.llm.worker(decision.model).cfg.max_position
        if len(prompt_ids) >= limit:
            raise GatewayError(422, f"the prompt is {len(prompt_ids)} tokens; model {decision.model!r} reads at "
                                    f"most {limit - 1}", code="prompt_too_long")
        try:
            params = SamplingParams(temperature=q.temperature, top_p=q.top_p, seed=q.seed,
                                    max_tokens=max_tokens, stop=q.stop,
                                    thinking_budget=decision.thinking_budget if thinking else None)
        except ValueError as e:
            raise GatewayError(422, str(e), code="bad_sampling_parameters") from None
        return Plan(request_id, tenant, q, decision, messages, prompt_ids, params, citations, trimmed, start,
                    retrieval_s)

    def _route(self, tenant: Tenant, q: Query, scores: list[float], vector) -> Decision:
        """mode=auto through the router's policy; a router that failed to load counts as a
        failed classifier, so the decision falls back to the tenant default and says why."""
        if self.router_error:
            def predict():
                raise RouterError(self.router_error)
        elif vector is not None:
            predict = lambda: self.router.classifier.predict(q.question, vector[0], scores)
        else:
            predict = None
        d = decide(tenant, "auto", q.mode_field, self.pair, predict)
        return replace(d, thinking_budget=q.thinking_budget) if q.thinking_budget else d

    def _prompt(self, tenant: Tenant, q: Query, tokenizer, embed: bool = False):
        """Chat messages for the engine: retrieved passages trimmed to the tenant's context
        budget in the system message, then the question (or the conversation). The composition
        itself is retrieval's rag_context, which evals measure too. Also the search scores and,
        when `embed`, the question's embedding: the router's features, the search reusing it.
        Returns (messages, citations, trimmed, scores, vector)."""
        budget = tenant.spec.context_budget
        collection = None
        if q.collection is not None:
            try:
                collection = self.store.collection(tenant.id, q.collection, create=False)
            except RetrievalError:       # another tenant's collection is as absent as a missing one
                raise GatewayError(404, f"collection {q.collection!r} not found", "collection",
                                   "collection_not_found") from None
        try:
            vector = self.embedder.encode([q.question]) if embed else None
            ctx = rag_context(collection, q.question, budget, tokenizer, self.config.retrieval_k, q.messages, vector)
        except OverBudget as e:
            raise GatewayError(422, f"the {e.what} is {e.tokens} tokens; tenant {tenant.id!r} has a context "
                                    f"budget of {budget}", code="over_context_budget") from None
        except RetrievalError as e:
            raise GatewayError(422, str(e), code="retrieval_refused") from None
        citations = [s.Citation(c.number, c.hit.chunk.id, c.hit.chunk.doc_id, c.hit.chunk.title, c.hit.score)
                     for c in ctx.citations]
        t = ctx.trimmed
        return (ctx.messages, citations, s.Trimmed(len(t.chunks), len(t.dropped), t.tokens, budget),
                [h.score for h in ctx.hits], vector)

    async def _settle(self, plan: Plan, p: Progress, queued: float, status: str) -> Done:
        """Write the ledger row (the request counts as answered only once it is committed)
        and the metrics."""
        model, completion = plan.decision.model, p.completion
        prompt = len(completion.prompt_token_ids) if completion else len(plan.prompt_ids)
        cached = completion.num_cached_tokens if completion else p.cached
        before = sum(len(c.token_ids) for c in p.earlier)        # p.tokens counts every call's
        produced = len(completion.token_ids) if completion else p.tokens - before     # thinking included
        thinking = (completion.num_thinking_tokens if completion else 0) + sum(c.num_thinking_tokens for c in p.earlier)
        # (model, prompt, cached, produced) per call: an escalated request pays for both.
        calls = [(c.model, len(c.prompt_token_ids), c.num_cached_tokens, len(c.token_ids)) for c in p.earlier]
        calls.append((model, prompt, cached, produced))
        cost = 0.0 if status == "error" else sum(cost_of(self.config.prices[c[0]], *c[1:]) for c in calls)
        prompt, cached, produced = (sum(c[i] for c in calls) for i in range(1, 4))
        now = time.monotonic()
        ms = lambda seconds: round(seconds * 1000, 3)
        timings = s.Timings(retrieval=ms(plan.retrieval_s), queue=ms(queued),
                            ttft=ms(p.first_token - plan.start) if p.first_token else None,
                            engine=ms(now - p.engine_start) if p.engine_start else 0.0, total=ms(now - plan.start))
        finish = completion.finish_reason if completion else "abort"
        answer = completion.text if completion else p.text
        d = plan.decision
        await self.ledger.record(UsageRow(
            plan.request_id, time.time(), month_of(time.time()), plan.tenant.id, plan.query.endpoint, status,
            model, ",".join(c[0] for c in calls), plan.query.collection, prompt, cached, produced, thinking, cost, timings.retrieval,
            timings.queue, timings.ttft, timings.total, d.reason, d.difficulty, d.confidence, d.escalated, finish))
        m, t = self.metrics, plan.tenant.id
        m.answers.inc(model, status)
        m.escalations.inc(amount=int(d.escalated))
        m.routes.inc(t, calls[0][0], d.difficulty or "none", d.source)     # the first call's model
        for name, *counts in calls:
            for kind, n in zip(("prompt", "cached", "completion"), counts):
                m.tokens.inc(t, name, kind, amount=n)
        m.tokens.inc(t, model, "thinking", amount=thinking)
        m.cost.inc(t, model, amount=cost)
        m.latency.observe(now - plan.start, model)
        m.queue_wait.observe(queued, model)
        m.retrieval.observe(plan.retrieval_s)
        if p.first_token:
            m.ttft.observe(p.first_token - plan.start, model)
        cited = sorted({int(n) for n in CITE.findall(answer)} & {c.number for c in plan.citations})
        return Done(plan.request_id, answer, s.Usage(prompt, cached, produced, thinking), cost, timings, finish, cited)

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
            return self.store.collection(tenant.id, name, create=create)
        except RetrievalError:
            raise GatewayError(404, f"collection {name!r} not found", "name", "collection_not_found") from None

    async def ingest(self, tenant: Tenant, name: str, documents: list) -> s.IngestResponse:
        collection = self._collection(tenant, name, create=True)
        try:
            report = await anyio.to_thread.run_sync(collection.ingest, documents, limiter=self._ingest)
        except RetrievalError as e:
            raise GatewayError(422, str(e), "documents", "bad_documents") from None
        return s.IngestResponse(name, report.documents, report.chunks, report.removed, report.embedded)

    async def delete(self, tenant: Tenant, name: str, doc_id: str) -> s.DeleteResponse:
        collection = self._collection(tenant, name, create=False)
        removed = await anyio.to_thread.run_sync(collection.delete, doc_id, limiter=self._ingest)
        if not removed:
            raise GatewayError(404, f"collection {name!r} has no document {doc_id!r}", "doc_id", "document_not_found")
        return s.DeleteResponse(name, doc_id, removed)

    def collections(self, tenant: Tenant) -> s.CollectionList:
        self._require_ready()
        out = []
        for name in self.store.names(tenant.id):
            c = self.store.collection(tenant.id, name, create=False)
            out.append(s.CollectionInfo(name, len(c.doc_ids()), len(c)))
        return s.CollectionList(out)

    def usage(self, tenant: Tenant, month: str | None = None) -> s.UsageReport:
        month = month or month_of(time.time())
        by_model = {m: s.UsageTotals(**u) for m, u in self.ledger.usage(tenant.id, month).items()}
        totals = s.UsageTotals(*(sum(getattr(u, f) for u in by_model.values()) for f in s.UsageTotals.__struct_fields__))
        cap = tenant.spec.limits.monthly_spend_cap_usd
        spent = self.ledger.spent(tenant.id, month)
        return s.UsageReport(tenant.id, month, totals, by_model, cap, max(0.0, cap - spent))
