"""The answer pipeline: how one question becomes engine calls, for the gateway and evals alike.

    check (budgets, mode) -> retrieve and trim -> route -> compose the prompt -> calls

`Pipeline.check` refuses cheaply what needs no work; `Pipeline.plan` retrieves, routes and
composes; `Answer` is the cascade as a small state machine that says which engine call comes
next (model, prompt, draft) given the calls so far: the routed model's, then, when its
confidence is under the tenant's threshold, the large model's, with the first answer offered
as its speculative draft (where the two agree that costs verification passes, not decode
steps, and the answer is still the large model's own). A narrow arm (the large model on the
best passage alone) escalates to itself: the same model asked again with the wider budget
its own arm reads (`large`'s from the context curve, within the tenant's); with the tenant's
`widen_from_cache`, the narrow call's passages first, so that its prompt extends the narrow
one's and the prefix cache serves that part. The gateway and evals both drive an Answer
through the async engine with `pipeline.driver.drive`; neither decides anything itself, so
what evals measure is what is served.

With an answer cache (the gateway's; evals run without one), `Pipeline.lookup` finds the
request's exact key before any work, `plan` may return a near duplicate's `Hit` once
retrieval has run, and `Pipeline.remember` files a finished answer (answer_cache.py).
"""
from __future__ import annotations

import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from engine import MIN_TEMPERATURE, Completion, KVWindow, Prompter, SamplingParams, StepOutput, ThinkingExit
from pipeline.answer_cache import AnswerCache, CachedPassage, CacheTerms, Entry, Hit, Lookup, normalize
from pipeline.prices import Price, cost
from retrieval import OverBudget, RagContext, RetrievalError, Selector, TrimResult, rag_context
from router.arms import Arm, arm_name, retrieved
from router.confidence import ConfidenceModel, EarlyExit, Verdict, judge
from router.data import RouterError
from router.model import RouterModel
from router.policy import Policy, Route, route, route_arms


def blank(text: str) -> bool:
    """Nothing to read: whitespace, control and format characters only (a zero-width space or
    a byte-order mark is no more a question than a space is)."""
    return all(c.isspace() or unicodedata.category(c) in ("Cc", "Cf") for c in text)


class Refused(Exception):
    """A question the pipeline will not answer: `status` as HTTP would say it, `param` the
    field at fault, `code` a stable machine-readable reason."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class Query:
    """One question, however it arrived (HTTP, the CLI, an eval)."""
    question: str                          # what retrieval searches for
    endpoint: str = "ask"                  # ask | chat | cli | eval, for the ledger
    messages: list[dict] | None = None     # a chat conversation; None: the question alone
    collection: str | None = None
    mode: str = "auto"                     # auto, or an engine model's name
    mode_field: str = "mode"               # the request field that carried the mode
    max_output_tokens: int | None = None   # None: the tenant's output budget
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    requested_thinking: int | None = None  # the client's thinking_budget; None: the route decides; 0: no thinking

    @property
    def input_field(self) -> str:
        """The request field that holds what the model reads."""
        return "question" if self.messages is None else "messages"


@dataclass(frozen=True)
class Terms:
    """A tenant's terms, as the pipeline applies them (the gateway reads them from a tenant
    file, evals from a run's settings)."""
    name: str
    policy: Policy
    context_budget: int
    output_budget: int
    salt: bytes                            # the engine's prefix-cache salt for its requests
    selection: bool = False                # the hits cut to what bears on the question (retrieval/select.py)
    cache: CacheTerms = CacheTerms()       # the answer cache's settings (off by default)
    # A conversation over the context budget: None refuses it (over_context_budget); a window
    # answers it without passages, the engine keeping only the window's sinks and recent tokens.
    window: KVWindow | None = None
    # Thinking that stops once the answer has settled (engine/early_exit.py); None: it runs to
    # its marker or its budget.
    thinking_exit: ThinkingExit | None = None

    @property
    def client_thinking_cap(self) -> int:
        """The most thinking tokens a request may ask for: the largest of the policy's."""
        return max(self.policy.thinking.values())


@dataclass
class Plan:
    """A question after retrieval and routing, ready for its first call."""
    request_id: str
    terms: Terms
    route: Route
    context: RagContext
    prompt_ids: list[int]                  # the routed model's prompt
    params: SamplingParams
    wide: RagContext | None = None         # what a widening escalation reads; None: the route does not widen
    window: KVWindow | None = None         # the conversation is over the budget: it runs through this KV window


@dataclass(frozen=True)
class EngineCall:
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    salt: bytes                            # the tenant's prefix-cache namespace
    draft: list[int] | None = None         # an earlier answer the engine verifies instead of decoding
    window: KVWindow | None = None         # keep only these sinks and recent tokens' KV (StreamingLLM)


class Models(Protocol):
    """What planning needs of the engine (an LLMEngine; the Ray ingress, tokenizers alone)."""

    def prompter(self, model: str) -> Prompter: ...

    def verifies_drafts(self, model: str) -> bool: ...


def call_cost(price: Price, c: Completion) -> float:
    return cost(price, len(c.prompt_token_ids), c.num_cached_tokens, c.num_billed_tokens)


class Pipeline:
    def __init__(self, engine: Models, prices: dict[str, Price], router: RouterModel | None = None,
                 router_error: str | None = None, embedder=None, pair: tuple[str, str] | None = None,
                 k: int = 8, max_input_chars: int | None = None, cache: AnswerCache | None = None):
        """`pair`: the (small, large) models mode=auto routes between; None: no router installed
        (auto is the tenant's default model, no escalation). `router`: the trained classifier
        and confidence model (None: no classifier, the stated confidence rule); `router_error`
        says why one failed to load, and every routed question falls back saying so. `cache`:
        the answer cache (None: every question is answered anew)."""
        self.engine, self.prices, self.router, self.router_error = engine, prices, router, router_error
        self.cache = cache
        self.embedder, self.pair, self.k, self.max_input_chars = embedder, pair, k, max_input_chars
        self.selector = Selector(top=k)
        # The router's arms name the models they were labelled with (small, large); here they
        # are the pair's, whatever the server calls them.
        self.arms: tuple[Arm, ...] = () if router is None or router.arms is None or pair is None else tuple(
            replace(a, model=dict(zip(("small", "large"), pair)).get(a.model, a.model)) for a in router.arms.arms)
        # What it offers a tenant whose passages are selected (True) or whole (False).
        self.offered = {s: tuple(a for a in self.arms if router.offers(a.name, s)) for s in (False, True)}

    @property
    def confidence(self) -> ConfidenceModel:
        return self.router.confidence if self.router else ConfidenceModel()

    @property
    def early(self) -> EarlyExit | None:
        return self.router.early if self.router else None

    def judge(self, plan: Plan, logprobs: list[float]) -> Verdict:
        """The verdict on a first answer: by the narrow arm's own confidence model when the
        route widens (the same model again, with a wider context), else by the small model's."""
        r = plan.route
        if r.escalate_to == r.model:
            return judge(f"{r.model} with a {plan.wide.trimmed.tokens}-token context",
                         plan.terms.policy.escalation_threshold, self.router.narrow[r.arm], logprobs)
        return judge(r.escalate_to, plan.terms.policy.escalation_threshold, self.confidence, logprobs)

    def check(self, terms: Terms, q: Query) -> int:
        """Refuse what needs no work to refuse; returns the request's output token limit."""
        if blank(q.question):
            if q.messages is None:
                raise Refused(422, "question has nothing to read: only whitespace, control or format characters",
                              "question", "blank_question")
            last = max(i for i, m in enumerate(q.messages) if m["role"] == "user")
            raise Refused(422, "the last user message has nothing to read: only whitespace, control or format "
                               "characters", f"messages[{last}].content", "blank_question")
        if q.requested_thinking is not None and q.requested_thinking > terms.client_thinking_cap:
            raise Refused(422, f"thinking_budget is {q.requested_thinking}; tenant {terms.name!r} allows at most "
                               f"{terms.client_thinking_cap} thinking tokens",
                          "thinking_budget", "over_thinking_budget")
        if self.max_input_chars is not None:
            chars = len(q.question) if q.messages is None else sum(len(m["content"]) for m in q.messages)
            if chars > self.max_input_chars:
                raise Refused(422, f"{q.input_field} has {chars} characters; the limit is {self.max_input_chars}",
                              q.input_field, "input_too_long")
        max_tokens = q.max_output_tokens or terms.output_budget
        if max_tokens > terms.output_budget:
            name = "max_output_tokens" if q.endpoint != "chat" else "max_tokens"
            raise Refused(422, f"{name} is {max_tokens}; tenant {terms.name!r} allows at most "
                               f"{terms.output_budget} output tokens", name, "over_output_budget")
        if q.mode != "auto" and q.mode not in terms.policy.allowed:
            raise Refused(403, f"tenant {terms.name!r} may not use model {q.mode!r}; allowed: "
                               f"{', '.join(['auto', *terms.policy.allowed])}", q.mode_field, "model_not_allowed")
        return max_tokens

    def routes_by_classifier(self, terms: Terms, q: Query) -> bool:
        return q.mode == "auto" and self.pair is not None and terms.policy.classifier and self.router is not None

    def lookup(self, terms: Terms, q: Query, collection) -> tuple[Lookup | None, Hit | None]:
        """The request's place in the answer cache and its exact hit; (None, None) when the
        tenant has no cache or the answer is sampled without a seed (no two are alike). Call it
        before retrieval: the collection's revision is read now, so an ingest that lands while
        the answer is made files it under the old revision, where nothing will look again."""
        if self.cache is None or not terms.cache.enabled:
            return None, None
        if q.temperature >= MIN_TEMPERATURE and q.seed is None:
            return None, None
        sampled = [q.temperature, q.top_p, q.seed] if q.temperature >= MIN_TEMPERATURE else None
        asked = None if q.messages is None else max(i for i, m in enumerate(q.messages) if m["role"] == "user")
        history = [[m["role"], None if i == asked else normalize(m["content"])] for i, m in enumerate(q.messages or [])]
        fields = {"terms": repr(replace(terms, cache=CacheTerms(), salt=b"")), "input": q.input_field,
                  "history": history, "mode": q.mode, "max_tokens": q.max_output_tokens or terms.output_budget,
                  "thinking": q.requested_thinking, "stop": list(q.stop), "sampled": sampled}
        revision = None if collection is None else collection.revision
        return self.cache.lookup(terms.name, terms.cache, fields, q.question, q.collection, revision,
                                 near=collection is not None)

    def plan(self, terms: Terms, q: Query, collection, request_id: str, lookup: Lookup | None = None) -> Plan | Hit:
        """Retrieve and trim, route, compose: the whole decision about a question. `collection`
        is a retrieval Collection or None (the question alone). With the request's cache
        `lookup` and the tenant's near duplicates, a cached answer to a near duplicate (its
        Hit) once the passages are known. CPU-bound: the gateway runs it in a thread."""
        max_tokens = self.check(terms, q)
        # The context is trimmed with the tokenizer of the model that answers first without a
        # router; the routed pair shares one tokenizer, so a route cannot change the count.
        first = q.mode if q.mode != "auto" else terms.policy.default_model
        embed, tokenizer = self.routes_by_classifier(terms, q), self.engine.prompter(first)
        near = lookup is not None and lookup.group is not None and self.embedder is not None
        selector = self.selector if terms.selection else None
        try:
            vector = self.embedder.encode([q.question]) if embed or near else None
            context = rag_context(collection, q.question, terms.context_budget, tokenizer, self.k, q.messages, vector,
                                  selector=selector)
        except OverBudget as e:
            if terms.window is None or q.messages is None:
                raise Refused(422, f"the {e.what} is {e.tokens} tokens; tenant {terms.name!r} has a context "
                                   f"budget of {terms.context_budget}", q.input_field, "over_context_budget") from None
            # The tenant's long_context = "window": the conversation alone, through a KV window.
            context = RagContext(q.messages, [], [], TrimResult([], [], e.tokens, terms.context_budget))
        except RetrievalError as e:
            raise Refused(422, str(e), code="retrieval_refused") from None
        if near:                 # the question's embedding and passages: what a near duplicate shares
            lookup.vector, lookup.passages = vector[0], tuple(p.hit.chunk.id for p in context.citations)
            if (hit := self.cache.near(lookup)) is not None:
                return hit
            vector = vector if embed else None
        scores = [h.score for h in context.hits]
        r = self.route(terms, q, self._predictor(q, vector, scores),
                       self._arm_cost(context.trimmed.tokens, retrieved(scores)), retrieved(scores))
        wide = None
        if r.context_budget is not None and r.context_budget < terms.context_budget and collection is not None:
            # The arm answers best from fewer passages (its context-budget curve): the same
            # search, trimmed to the arm's budget.
            whole = context
            trimmed = lambda budget, lead=(): rag_context(collection, q.question, budget, tokenizer, self.k,
                                                          q.messages, vector, lead, whole.hits, selector)
            try:
                context = trimmed(r.context_budget)
                r = replace(r, reason=f"{r.reason}; context trimmed to the arm's {r.context_budget} tokens")
                if r.escalate_to == r.model:       # widening: the context the model's own arm reads,
                    # led by the narrow call's passages where the tenant widens from the cache
                    budget = self._wide_budget(r, terms)
                    lead = context.trimmed.chunks if terms.policy.widen_from_cache else ()
                    wide = whole if budget >= terms.context_budget and not lead else trimmed(budget, lead)
            except RetrievalError:       # the question alone is over the arm's budget: the tenant's stands
                r = replace(r, context_budget=None)
        if r.escalate_to == r.model and (wide is None or wide.trimmed.tokens <= context.trimmed.tokens):
            r, wide = replace(r, escalate_to=None), None    # nothing wider to ask it again with
        try:
            params = SamplingParams(temperature=q.temperature, top_p=q.top_p, seed=q.seed, max_tokens=max_tokens,
                                    stop=q.stop, max_thinking_tokens=r.thinking_tokens,
                                    thinking_exit=terms.thinking_exit if r.thinking_tokens else None)
        except ValueError as e:
            raise Refused(422, str(e), code="bad_sampling_parameters") from None
        window = terms.window if context.trimmed.tokens > terms.context_budget else None
        return Plan(request_id, terms, r, context, self.prompt_ids(context, r.model, params), params, wide, window)

    def route(self, terms: Terms, q: Query, predict: Callable | None,
              arm_cost: Callable[[Arm], float] | None = None, kind: bool = True) -> Route:
        """The one place a route is chosen: the tenant's policy (among the trained router's
        arms when it has them), then the client's override (an explicit model, an explicit
        thinking budget, 0 included), each once."""
        if q.mode != "auto":
            r = Route(q.mode, "requested by the client", source="client")
        elif self.pair is None:
            r = Route(terms.policy.default_model, "router not installed; tenant default", source="no_router")
        elif self.arms:
            arms = self.offered[terms.selection]
            r = route_arms(terms.policy, arms, *self.pair, predict, arm_cost, frozenset(self.router.narrow), kind)
            if len(arms) < len(self.arms) and r.source == "arms":
                read, tenant = ("selected", "whole") if self.router.selection else ("whole", "selected")
                r = replace(r, reason=f"{r.reason}; no narrow arm: its labels read {read} passages, this tenant's "
                                      f"are {tenant}")
        else:
            r = route(terms.policy, *self.pair, predict)
        if q.requested_thinking is not None and q.requested_thinking != r.thinking_tokens:
            r = replace(r, thinking_tokens=q.requested_thinking,
                        reason=f"{r.reason}; thinking budget {q.requested_thinking} from the client")
        return r

    def _predictor(self, q: Query, vector, scores: list[float]) -> Callable | None:
        if self.router_error:
            def predict():
                raise RouterError(self.router_error)
            return predict
        if vector is None:
            return None
        if self.arms:
            return lambda: self.router.arms.predict(q.question, vector[0], scores)
        return lambda: self.router.classifier.predict(q.question, vector[0], scores)

    def _wide_budget(self, r: Route, terms: Terms) -> int:
        """The context a widened answer reads: its model's plain arm's (`large` for `large@256`,
        its budget from the context curve), within the tenant's; the tenant's without one."""
        plain = arm_name(r.model, r.thinking_tokens)
        budget = next((a.context_budget for a in self.arms if a.name == plain), None)
        return min(budget or terms.context_budget, terms.context_budget)

    def _arm_cost(self, context_tokens: int, kind: bool) -> Callable[[Arm], float] | None:
        """An arm's expected dollars at the server's prices: the context as trimmed (to the
        arm's budget at most), and the output its labels spent on average on this kind of
        question (router.arms.retrieved), thinking included."""
        if not self.arms:
            return None
        return lambda arm: cost(self.prices[arm.model], min(context_tokens, arm.context_budget or context_tokens), 0,
                                round(self.router.arms.output_tokens(arm.name, kind)))

    def prompt_ids(self, context: RagContext, model: str, params: SamplingParams) -> list[int]:
        """The context's messages in `model`'s own chat template."""
        prompter = self.engine.prompter(model)
        ids = prompter.chat(context.messages, thinking=params.max_thinking_tokens > 0)
        if len(ids) >= prompter.max_position:
            raise Refused(422, f"the prompt is {len(ids)} tokens; model {model!r} reads at most "
                               f"{prompter.max_position - 1}", code="prompt_too_long")
        return ids

    def estimate(self, plan: Plan) -> tuple[int, float]:
        """The most tokens and dollars the plan can spend: every call it may make, each writing
        its whole output and thinking budgets and the tokens budget forcing adds."""
        params, r = plan.params, plan.route
        models = [m for m in (r.model, r.escalate_to) if m]
        prompts = [len(plan.prompt_ids)] * len(models)
        if plan.wide is not None and len(models) > 1:       # an escalation that widens reads more
            prompts[1] += plan.wide.trimmed.tokens - plan.context.trimmed.tokens
        extra = lambda p: p.forced_tokens + p.probe_tokens(params) if params.max_thinking_tokens else 0  # noqa: E731
        out = lambda m: params.max_tokens + params.max_thinking_tokens + extra(self.engine.prompter(m))
        return (sum(p + out(m) for m, p in zip(models, prompts)),
                sum(cost(self.prices[m], p, 0, out(m)) for m, p in zip(models, prompts)))

    def answer(self, plan: Plan) -> Answer:
        return Answer(self, plan)

    def remember(self, lookup: Lookup | None, answer: Answer) -> bool:
        """File an answer in the cache if it is finished: every call made and the last one
        ended by its stop or length, never cut (an error, a timeout, a client gone, a stream
        closed midway all leave it unfinished). True if it was stored."""
        if self.cache is None or lookup is None or not answer.calls or answer.next_call() is not None:
            return False
        last, plan, r = answer.calls[-1], answer.plan, answer.route
        if last.finish_reason not in ("stop", "length"):
            return False
        ctx, t = plan.context, plan.context.trimmed
        citations = [CachedPassage(c.number, c.hit.chunk.id, c.hit.chunk.doc_id, c.hit.chunk.title, c.hit.score)
                     for c in ctx.citations]
        tokens = tuple(sum(f(c) for c in answer.calls) for f in (
            lambda c: len(c.prompt_token_ids), lambda c: c.num_cached_tokens, lambda c: len(c.token_ids),
            lambda c: c.num_thinking_tokens))
        entry = Entry(lookup.tenant, lookup.collection, lookup.revision, plan.request_id, lookup.question, last.text,
                      last.finish_reason, r.model, r.reason, r.difficulty, r.confidence, r.escalated, r.arm, citations,
                      ctx.cited(last.text), (len(t.chunks), len(t.dropped), t.tokens, t.budget), tokens,
                      answer.cost(), time.time())
        return self.cache.remember(lookup, entry)


class Answer:
    """One question's calls: the routed model's, then perhaps the escalation's.

    A driver puts `next_call()` into the engine, shows each of its outputs to `observe`, and
    gives its completion to `finish`, until `next_call()` is None. When `observe` returns an
    escalating verdict (the first answer judged on its first tokens), the driver cuts the call
    (the engine's abort, which returns what it had produced) and finishes it with that: the
    cut answer is paid for and drafts for the large model."""

    def __init__(self, pipeline: Pipeline, plan: Plan):
        self.pipeline, self.plan = pipeline, plan
        self.calls: list[Completion] = []
        self.verdict: Verdict | None = None
        self._early_judged = False
        self.cut_early = False                 # the first call was cut short by the early verdict
        self.widened = False                   # escalated to the same model with a wider context
        self._logprobs: list[float] = []      # of the first call so far, for the early verdict

    @property
    def route(self) -> Route:
        return self.plan.route

    @property
    def may_escalate(self) -> bool:
        """Whether the first answer could still be replaced (a stream holds it until judged)."""
        return self.route.escalate_to is not None and self.verdict is None

    def next_call(self) -> EngineCall | None:
        """The next engine call, or None once the answer stands."""
        plan, r = self.plan, self.plan.route
        if not self.calls:
            return EngineCall(r.model, plan.prompt_ids, plan.params, plan.request_id, plan.terms.salt,
                              window=plan.window)
        if self.verdict is None or not self.verdict.escalate or len(self.calls) > 1:
            return None
        first = self.calls[0]
        draft = list(first.token_ids) if self.pipeline.engine.verifies_drafts(r.model) and first.token_ids else None
        return EngineCall(r.model, self.pipeline.prompt_ids(plan.context, r.model, plan.params), plan.params,
                          f"{plan.request_id}-escalated", plan.terms.salt, draft, plan.window)

    def observe(self, out: StepOutput) -> Verdict | None:
        """An output of the call in flight; the early verdict once the first answer has its
        first k tokens (k: the trained router's), if the tenant judges early."""
        early, r = self.pipeline.early, self.plan.route
        # The early model knows the small model's prefixes only: a narrow arm is judged whole.
        if (early is None or self._early_judged or self.calls or r.escalate_to in (None, r.model)
                or not self.plan.terms.policy.early_escalation):
            return None
        self._logprobs += out.new_logprobs
        if out.completion is not None:        # done within k tokens: judged whole, in `finish`
            return None
        if len(self._logprobs) < early.tokens:
            return None
        self._early_judged = True
        v = judge(r.escalate_to, self.plan.terms.policy.escalation_threshold, early.confidence,
                  self._logprobs[:early.tokens])
        if v.escalate:
            self.cut_early = True
            self._judged(replace(v, reason=f"after {early.tokens} tokens, {v.reason}"))
        return v

    def finish(self, completion: Completion) -> Verdict | None:
        """Record a call's completion; after a first call that may escalate, the verdict on it
        (for a call cut short, the early verdict that cut it)."""
        self.calls.append(completion)
        r = self.plan.route
        if len(self.calls) > 1 or r.escalate_to is None:
            return None
        if self.verdict is None:
            self._judged(self.pipeline.judge(self.plan, completion.logprobs))
        return self.verdict

    def _judged(self, v: Verdict) -> None:
        r = self.plan.route
        self.verdict = v
        if v.escalate and self.plan.wide is not None:    # the escalation answers from the wider context
            self.plan.context, self.widened = self.plan.wide, True
        self.plan.route = replace(r, reason=f"{r.reason}; {v.reason}", confidence=v.confidence, escalated=v.escalate,
                                  model=r.escalate_to if v.escalate else r.model)

    def cost(self) -> float:
        """Dollars for every call made (an escalated question pays for both)."""
        return sum(call_cost(self.pipeline.prices[c.model], c) for c in self.calls)
