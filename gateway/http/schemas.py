"""Every HTTP body, request and response, as a msgspec struct: validated on the way in
(strictly: a string is never taken for a number), encoded on the way out, and described in
the OpenAPI schema from the same definitions (gateway/http/openapi.py). Request bodies refuse
unknown fields, and every bound the server enforces on a field is stated here."""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from engine import MIN_SEED, MIN_TEMPERATURE, MIN_TOP_P

Mode = Literal["auto", "small", "large"]
# The rule retrieval's store applies to collection names (retrieval/collection.py, NAME).
COLLECTION_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
COLLECTION_NAME_RULE = "1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"
MONTH = r"^\d{4}-(0[1-9]|1[0-2])$"      # YYYY-MM
CollectionName = Annotated[str, Meta(pattern=COLLECTION_NAME, description=COLLECTION_NAME_RULE)]
# The sampler's own limits (engine/sampling_params.py): every value here samples safely.
Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description=f"0, or below {MIN_TEMPERATURE}: greedy")]
TopP = Annotated[float, Meta(gt=MIN_TOP_P, le=1.0)]
# A seed is OpenAI's signed 64-bit integer (the sampler takes up to 2**64 - 1, but msgspec's
# bounds stop at int64).
Seed = Annotated[int, Meta(ge=MIN_SEED, le=2**63 - 1)]
PositiveInt = Annotated[int, Meta(ge=1)]
StopString = Annotated[str, Meta(min_length=1)]


# Limits of the tenant that a request fitting this schema can still pass, which no schema can
# state: each field names its own, with the status (400 on /v1/chat/completions, as OpenAI's).
def _output_limit(status: int) -> str:
    return (f"Default and maximum: the tenant's output budget; more is refused ({status} over_output_budget). "
            f"Thinking tokens are not counted in it.")


def _question_limit(status: int) -> str:
    return (f"Must have something to read, not only whitespace, control or format characters ({status} "
            f"blank_question), and fit the tenant's context budget with the instructions ({status} "
            f"over_context_budget).")


# ---------------------------------------------------------------------------- /v1/ask

class AskRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    question: Annotated[str, Meta(min_length=1, description=_question_limit(422))]
    collection: CollectionName | None = None
    stream: bool = False
    max_output_tokens: Annotated[PositiveInt | None, Meta(description=_output_limit(422))] = None
    mode: Mode = "auto"
    thinking_budget: Annotated[Annotated[int, Meta(ge=0)] | None, Meta(description=(
        "Thinking tokens before the answer; unset: the route decides, 0: none. At most the largest of the "
        "tenant's thinking budgets; more is refused (422 over_thinking_budget)."))] = None
    temperature: Temperature = 0.0                  # 0: greedy
    top_p: TopP = 1.0
    seed: Seed | None = None


# The answer cache (docs/gateway.md): "hit" for an answer served from it (no tokens; usage 0),
# "miss" for one made now, absent when the tenant's cache is off or the request is not cacheable.
CacheStatus = Annotated[Literal["hit", "miss"] | None, Meta(description=(
    "hit: served from the tenant's answer cache (usage 0, cost the tenant's hit price); miss: made now and "
    "filed there; null: no cache for this request"))]
CacheAge = Annotated[float | None, Meta(description="seconds since the cached answer was made (hits only)")]


class Citation(Struct):
    number: int          # as the model cites it: [1]
    chunk_id: str
    doc_id: str
    title: str
    score: float
    page: int | None = None        # PDF: the page the passage starts on (from 1)
    page_end: int | None = None    # ...and the page it ends on
    section: str | None = None     # Markdown, HTML, Word: the headings it sits under ("Install > Linux")


class Usage(Struct):
    prompt: int
    cached: int          # of the prompt tokens, those served from the prefix cache
    completion: int
    thinking: int


class Timings(Struct):
    """Milliseconds. `engine` is the time inside the engine (from submission to the last
    token); what `total` holds beyond retrieval, queue and engine is the gateway's own."""
    retrieval: float
    queue: float
    ttft: float | None
    engine: float
    total: float


class Trimmed(Struct):
    kept: int            # passages in the prompt
    dropped: int         # retrieved but left out: near-duplicates or over the budget
    tokens: int          # prompt text tokens counted against the context budget
    budget: int


class RouteSummary(Struct):
    """The route as a client sees it (router.policy.Route is the whole decision record)."""
    model: str
    route_reason: str
    difficulty: str | None
    confidence: float | None
    escalated: bool
    arm: str | None = None   # the router's arm (model, thinking and context budget); None: not routed by arms


class AskResponse(Struct):
    id: str
    answer: str
    citations: list[Citation]
    cited: list[int]     # passage numbers the answer refers to
    model: str
    escalated: bool
    difficulty: str | None
    confidence: float | None
    route_reason: str
    usage: Usage
    cost: float          # US dollars
    timings: Timings
    trimmed: Trimmed
    finish_reason: str
    arm: str | None = None   # the router's arm (small, large, large+think256, ...); None: not routed by arms
    cache: CacheStatus = None
    cache_age_s: CacheAge = None


# SSE events of a streamed /v1/ask: meta, then token..., then done (or error).

class MetaEvent(Struct):
    id: str
    route: RouteSummary
    citations: list[Citation]
    trimmed: Trimmed
    cache: CacheStatus = None
    cache_age_s: CacheAge = None


class TokenEvent(Struct):
    text: str


class DoneEvent(Struct):
    id: str
    usage: Usage
    cost: float
    timings: Timings
    finish_reason: str
    cited: list[int]


# ------------------------------------------------------------- /v1/chat/completions

class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ChatRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's request, the fields Sluice honours. Others (tools, logprobs, presence_penalty,
    ...) are refused with a 400 naming the field rather than silently not done. `collection`
    is Sluice's own: set it (with the SDK's extra_body) to answer from that collection's
    passages."""
    model: str
    messages: Annotated[list[ChatMessage], Meta(min_length=1, description=(
        "At least one from the user; the last of those is the question. " + _question_limit(400)))]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[PositiveInt | None, Meta(description=_output_limit(400))] = None
    max_completion_tokens: Annotated[PositiveInt | None, Meta(description=_output_limit(400))] = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: StopString | list[StopString] | None = None
    n: Annotated[int, Meta(ge=1, le=1, description="one choice per request")] = 1
    collection: CollectionName | None = None


class AssistantMessage(Struct):
    content: str
    role: str = "assistant"


class Choice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class PromptTokensDetails(Struct):
    cached_tokens: int   # of prompt_tokens, those served from the prefix cache


class CompletionTokensDetails(Struct):
    reasoning_tokens: int    # of completion_tokens, the thinking span's


class BilledUsage(Struct):
    """Every engine call the request made, as the ledger and `sluice.cost` bill it: under
    model=auto the cascade's first answer too when it was escalated (cut short or whole)."""
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int


class ChatUsage(Struct):
    """OpenAI's fields count the call whose completion is returned: `prompt_tokens` its prompt
    (system message, passages and conversation in that model's chat template),
    `completion_tokens` its output, thinking included. `sluice_billed` adds the request's other
    calls."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    sluice_billed: BilledUsage


class SluiceInfo(Struct):
    """What /v1/ask reports beyond OpenAI's fields: the route, passages, cost and timings."""
    route: RouteSummary
    citations: list[Citation]
    trimmed: Trimmed
    cost: float | None = None
    timings: Timings | None = None
    cache: CacheStatus = None
    cache_age_s: CacheAge = None
    # The conversation was over the context budget and the tenant's long_context is "window":
    # tokens of it the engine's KV window dropped (0: it ran windowed, nothing dropped yet).
    # None: it fit the budget.
    evicted_tokens: int | None = None


class ChatCompletion(Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: ChatUsage
    sluice: SluiceInfo
    system_fingerprint: str | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct, omit_defaults=True):
    """`usage` only in the usage chunk, `sluice` (route, citations, cost, timings) only in
    the last chunk with a choice."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None
    sluice: SluiceInfo | None = None


class ModelCard(Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "sluice"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


# ------------------------------------------------------------------ collections

class DocumentIn(Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, Meta(min_length=1, max_length=512, description=(
        "Must hold a character other than whitespace (422 bad_document), and appear once in a request "
        "(422 bad_documents)."))]
    text: Annotated[str, Meta(min_length=1, description=(
        "Must hold a character other than whitespace once its format is read (422 bad_document)."))]
    title: str = ""
    format: Literal["text", "markdown", "html"] = "text"
    metadata: dict[str, Any] = {}


class IngestRequest(Struct, forbid_unknown_fields=True):
    documents: Annotated[list[DocumentIn], Meta(min_length=1, max_length=1000)]


class IngestResponse(Struct):
    collection: str
    documents: int
    chunks: int          # chunks now stored for these documents
    removed: int         # chunks they replaced
    embedded: int        # chunks embedded anew (unchanged chunks keep their vectors)
    added: int = 0       # documents new to the collection
    replaced: int = 0    # documents whose content changed: their old chunks replaced in one step
    unchanged: int = 0   # documents skipped: the same content as stored


class DeleteResponse(Struct):
    collection: str
    document: str
    deleted_chunks: int


class CollectionInfo(Struct):
    name: str
    documents: int
    chunks: int


class CollectionList(Struct):
    collections: list[CollectionInfo]


# ------------------------------------------------------------------------ usage

class UsageTotals(Struct):
    requests: int
    prompt: int
    cached: int
    completion: int
    thinking: int
    cost: float


class UsageReport(Struct):
    tenant: str
    month: str           # YYYY-MM, UTC
    totals: UsageTotals
    by_model: dict[str, UsageTotals]
    spend_cap: float
    remaining: float


class Health(Struct):
    status: str
    detail: str | None = None
    models: list[str] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------- the operator's view
# GET /v1/admin/summary (gateway/http/admin.py), and the /dashboard page drawn from it.

Window = Literal["hour", "day", "month"]


class Tokens(Struct):
    prompt: int          # cached included
    cached: int
    completion: int      # thinking included
    thinking: int


class TenantFigures(Struct):
    """One tenant's figures in the window (`tenant` "*": every tenant's together)."""
    tenant: str
    requests: int                  # that reached the engine (the ledger's rows)
    answers: int                   # of those, answered in full (status ok)
    outcomes: dict[str, int]       # ledger status (ok, cancelled, error, timeout) -> requests
    refused: dict[str, int]        # HTTP status >= 400 -> responses, since this process started
    cost: float                    # US dollars, as billed
    large_alone_cost: float        # the same requests answered by the large model alone (estimated)
    saved: float                   # large_alone_cost - cost
    month_spend: float             # this calendar month (UTC), as the spend cap counts it
    spend_cap: float | None        # the tenant file's monthly cap; None for a tenant no longer loaded
    tokens: Tokens
    arms: dict[str, int]           # arm (or the model, where not routed by arms) -> requests
    escalations: int               # to another model
    widenings: int                 # to the same model with a wider context
    cache_hits: int                # answered from the answer cache


class ArmShare(Struct):
    arm: str
    requests: int
    share: float


class Savings(Struct):
    cost: float
    large_alone_cost: float
    saved: float
    saved_share: float | None      # saved / large_alone_cost
    large_model: str
    method: str


class Percentiles(Struct):
    p50: float | None
    p95: float | None
    p99: float | None


class LatencyFigures(Struct):
    ttft_ms: Percentiles
    total_ms: Percentiles
    method: str


class ModelState(Struct):
    """Now, from the engine (as /metrics reads it)."""
    model: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_used_share: float | None
    prefix_cache_hit_share: float | None    # full blocks found cached over looked up, since start


class QueueState(Struct):
    inflight: int        # holding an engine slot
    queued: int          # waiting for one


class SeriesPoint(Struct):
    start: int           # unix seconds the bucket starts
    requests: int
    errors: int          # status other than ok
    cost: float
    large_alone_cost: float
    ttft_p50_ms: float | None
    total_p50_ms: float | None
    total_p95_ms: float | None


class AdminSummary(Struct):
    window: Window
    start: str                     # ISO 8601 UTC: whole series points, the last one holding `end`
    end: str
    bucket_s: int                  # seconds a series point spans: 60 (hour), 3600 (day), 86400 (month)
    tenant: str | None             # the tenant asked for; None: all
    totals: TenantFigures
    tenants: list[TenantFigures]
    arms: list[ArmShare]
    savings: Savings
    latency: LatencyFigures
    queue: QueueState
    models: list[ModelState]
    series: list[SeriesPoint]
