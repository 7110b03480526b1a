"""The gateway through Litestar's test client: every endpoint's happy path, SSE framing,
OpenAI-compatible shapes, tenant files, limits and the ledger. (The bad-input matrix is in
test_gateway_hardening.py.)"""
from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import uuid
from typing import Literal

import msgspec
import pytest
from litestar.testing import TestClient

from engine.config import SpecConfig
from engine.llm_engine import LLMEngine
from gateway.config import ConfigError
from gateway.http.app import create_app
from gateway.service import Query
from gateway.tenants import check_folder, load_tenant
from tests.test_gateway_support import (  # noqa: F401
    DOCS,
    KEYS,
    auth,
    embedder,
    engine_config,
    llm,
    make_gateway,
    parse_sse,
    tenant_toml,
    wait_ready,
)


@pytest.fixture
def gateway(tmp_path, llm, embedder):
    return make_gateway(tmp_path, llm, embedder)


@pytest.fixture
def client(gateway):
    with TestClient(create_app(gateway)) as c:
        wait_ready(c)
        yield c


def unique_question(n: int = 6) -> str:
    """Words no other test asks, so the shared engine's prefix cache starts cold for it."""
    seed = uuid.uuid4().int
    return " ".join(f"t{(seed >> (7 * i)) % 120 + 1}" for i in range(n))


def ask(client, tenant="alpha", **body):
    return client.post("/v1/ask", json={"question": "t1 t2 t3", "max_output_tokens": 4, **body}, headers=auth(tenant))


def rewrite(path, text: str) -> None:
    """Write a tenant file and move its mtime forward, as an editor's save would."""
    path.write_text(text)
    later = time.time_ns() + 2_000_000_000
    os.utime(path, ns=(later, later))


# ------------------------------------------------------------------ public endpoints

PROM_LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]\w*="([^"\\]|\\.)*",?)*\})? [-+0-9.eEInf]+$')


def test_health_ready_openapi_and_metrics(client):
    assert client.get("/healthz").json()["status"] == "ok"
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["models"] == ["large", "small"]

    schema = client.get("/schema/openapi.json").json()
    assert {"/v1/ask", "/v1/chat/completions", "/v1/models", "/v1/collections", "/v1/collections/{name}/documents",
            "/v1/collections/{name}/files", "/v1/collections/{name}/documents/{doc_id}", "/v1/usage", "/healthz",
            "/readyz", "/metrics"} <= set(schema["paths"])
    assert {"AskRequest", "AskResponse", "ChatRequest", "ChatCompletion",
            "UsageReport"} <= set(schema["components"]["schemas"])
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/ask"]["post"]["security"] == [{"bearer": []}]

    assert ask(client).status_code == 200
    m = client.get("/metrics")
    assert m.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = m.text
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or PROM_LINE.match(line), line
    for family in ["sluice_http_requests_total", "sluice_tokens_total", "sluice_cost_usd_total",
                   "sluice_prefix_cache_hit_rate", "sluice_escalation_rate", "sluice_queue_depth",
                   "sluice_request_seconds_bucket", "sluice_ttft_seconds_bucket", "sluice_engine_waiting",
                   "sluice_tenant_reloads_total"]:
        assert family in text, family
    assert 'sluice_http_requests_total{route="/v1/ask",code="200",tenant="alpha"} 1' in text
    assert 'sluice_answers_total{model="small",status="ok"} 1' in text
    assert 'sluice_tokens_total{tenant="alpha",model="small",kind="completion"} 4' in text
    assert 'sluice_route_decisions_total{tenant="alpha",model="small",difficulty="none",source="no_router"} 1' in text


def test_not_ready_until_models_load(tmp_path, llm, embedder):
    gate = threading.Event()
    gw = make_gateway(tmp_path, llm, embedder)
    load = gw._load_blocking
    gw._load_blocking = lambda: (gate.wait(30), load())
    with TestClient(create_app(gw)) as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["retry-after"]
        r = ask(c)
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"] and r.headers["retry-after"]
        gate.set()
        wait_ready(c)
        assert ask(c).status_code == 200
    assert len(gw.ledger.rows()) == 1


# --------------------------------------------------------------------------- /v1/ask

def test_thinking_budget_is_spent_exactly_and_counted_apart(tmp_path, llm, embedder):
    gw = make_gateway(tmp_path, llm, embedder, tenants={"alpha": tenant_toml(KEYS["alpha"], thinking=6)})
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        r = ask(c, question=unique_question(), max_output_tokens=5, thinking_budget=6)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        # The tiny model never writes the closing marker: the engine forces it at exactly 6.
        assert u["thinking"] == 6 and u["completion"] > 6 + 5
        assert gw.ledger.rows()[0].thinking_tokens == 6
        over = ask(c, thinking_budget=7)
        assert over.status_code == 422 and "allows at most 6 thinking tokens" in over.json()["error"]["message"]


def test_ask_answers_and_writes_exactly_one_ledger_row(client, gateway):
    r = ask(client, question=unique_question(), max_output_tokens=5)
    assert r.status_code == 200
    body = r.json()
    assert (body["model"], body["route_reason"]) == ("small", "router not installed; tenant default")
    assert body["difficulty"] is None and body["confidence"] is None and body["escalated"] is False
    assert body["finish_reason"] == "length" and body["answer"]
    u = body["usage"]
    assert u["completion"] == 5 and u["thinking"] == 0 and u["prompt"] > u["cached"] >= 0
    assert body["cost"] == pytest.approx(((u["prompt"] - u["cached"]) * 1000 + u["cached"] * 250 + 5 * 2000) / 1e6)
    t = body["timings"]
    assert set(t) == {"retrieval", "queue", "ttft", "engine", "total"}
    assert 0 < t["ttft"] <= t["total"] and t["engine"] <= t["total"]
    assert body["trimmed"] == {"kept": 0, "dropped": 0, "tokens": 6, "budget": 400}
    assert body["citations"] == [] and body["cited"] == []
    [row] = gateway.ledger.rows()
    assert ((row.request_id, row.tenant, row.endpoint, row.status, row.model)
            == (body["id"], "alpha", "ask", "ok", "small"))
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (u["prompt"], u["cached"], 5)
    assert row.cost == pytest.approx(body["cost"]) and row.route_reason == body["route_reason"]

    large = ask(client, mode="large", max_output_tokens=2).json()
    assert ((large["model"], large["route_reason"], large["usage"]["completion"])
            == ("large", "requested by the client", 2))
    assert len(gateway.ledger.rows()) == 2


def test_ask_from_a_collection_cites_passages_and_trims_to_budget(tmp_path, llm, embedder):
    # Whole passages: what trimming keeps and drops is counted in passages.
    tenants = {"alpha": tenant_toml(KEYS["alpha"], selection=False),
               "beta": tenant_toml(KEYS["beta"], context=70, selection=False)}
    gw = make_gateway(tmp_path, llm, embedder, tenants)
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        for tenant in ("alpha", "beta"):
            assert c.post("/v1/collections/cities/documents", json=DOCS, headers=auth(tenant)).status_code == 200
        body = ask(c, question="What is the capital of France?", collection="cities").json()
        assert [x["number"] for x in body["citations"]] == [1, 2, 3]
        assert {x["doc_id"] for x in body["citations"]} == {"paris", "berlin", "rome"}
        assert all(x["chunk_id"] == f"{x['doc_id']}#0" and x["title"] for x in body["citations"])
        assert body["trimmed"]["kept"] == 3 and body["trimmed"]["dropped"] == 0
        # Beta's context budget holds the instructions, the question and one passage.
        small = ask(c, "beta", question="What is the capital of France?", collection="cities").json()
        assert small["trimmed"]["kept"] >= 1 and small["trimmed"]["dropped"] >= 1
        assert small["trimmed"]["tokens"] <= small["trimmed"]["budget"] == 70
        assert len(small["citations"]) == small["trimmed"]["kept"]
        # A question too long for any passage is refused, and says why.
        r = ask(c, "beta", question=" ".join(["t9"] * 60), collection="cities")
        assert r.status_code == 422 and "context budget of 70 tokens" in r.json()["error"]["message"]
    assert len(gw.ledger.rows()) == 2


def test_tenants_see_and_search_only_their_own_collections(client, gateway):
    assert client.post("/v1/collections/cities/documents", json=DOCS, headers=auth("alpha")).json() == {
        "collection": "cities", "documents": 3, "chunks": 3, "removed": 0, "embedded": 3, "added": 3, "replaced": 0,
        "unchanged": 0}
    r = ask(client, "beta", question="capital of France?", collection="cities")
    assert r.status_code == 404 and r.json()["error"]["message"] == "collection 'cities' not found"
    assert client.get("/v1/collections", headers=auth("beta")).json() == {"collections": []}
    assert client.delete("/v1/collections/cities/documents/paris", headers=auth("beta")).status_code == 404
    # Beta's own "cities" is another collection; alpha's is untouched.
    one = {"documents": DOCS["documents"][:1]}
    assert client.post("/v1/collections/cities/documents", json=one, headers=auth("beta")).json()["documents"] == 1
    assert client.get("/v1/collections", headers=auth("alpha")).json() == {
        "collections": [{"name": "cities", "documents": 3, "chunks": 3}]}
    assert client.get("/v1/collections", headers=auth("beta")).json() == {
        "collections": [{"name": "cities", "documents": 1, "chunks": 1}]}
    # Usage too is the caller's own.
    assert ask(client, "alpha").status_code == 200
    assert client.get("/v1/usage", headers=auth("alpha")).json()["totals"]["requests"] == 1
    assert client.get("/v1/usage", headers=auth("beta")).json()["totals"]["requests"] == 0


def test_documents_add_replace_and_delete(client):
    url = "/v1/collections/cities/documents"
    assert client.post(url, json=DOCS, headers=auth()).json()["embedded"] == 3
    again = client.post(url, json=DOCS, headers=auth()).json()
    assert (again["unchanged"], again["removed"], again["embedded"]) == (3, 0, 0)   # the same content: skipped
    edited = {"documents": [{**DOCS["documents"][0], "title": "Paris, France"}]}
    again = client.post(url, json=edited, headers=auth()).json()
    assert (again["replaced"], again["removed"], again["embedded"]) == (1, 1, 0)   # same text: its vector kept
    nested = {"documents": [{"id": "guides/intro.md", "format": "markdown", "text": "# Intro\n\nHello there."}]}
    assert client.post(url, json=nested, headers=auth()).json()["documents"] == 1
    assert client.delete(f"{url}/guides/intro.md", headers=auth()).json() == {
        "collection": "cities", "document": "guides/intro.md", "deleted_chunks": 1}
    assert client.delete(f"{url}/paris", headers=auth()).json()["deleted_chunks"] == 1
    r = client.delete(f"{url}/paris", headers=auth())
    assert r.status_code == 404 and "has no document 'paris'" in r.json()["error"]["message"]
    assert client.delete("/v1/collections/nope/documents/paris", headers=auth()).status_code == 404
    assert client.get("/v1/collections", headers=auth()).json()["collections"][0]["documents"] == 2


def test_streamed_ask_is_framed_as_server_sent_events(client, gateway):
    question = unique_question(20)                        # a full KV block, to see the cache hit
    plain = ask(client, question=question, max_output_tokens=6).json()
    r = ask(client, question=question, max_output_tokens=6, stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream") and r.headers["cache-control"] == "no-cache"
    frames = parse_sse(r.text)
    kinds = [event for event, _ in frames]
    assert kinds[0] == "meta" and kinds[-1] == "done" and set(kinds[1:-1]) == {"token"}
    meta, done = msgspec.json.decode(frames[0][1]), msgspec.json.decode(frames[-1][1])
    assert meta["id"] == done["id"] == r.headers["x-request-id"]
    assert meta["route"] == {"model": "small", "route_reason": "router not installed; tenant default",
                             "difficulty": None, "confidence": None, "escalated": False, "arm": None}
    assert meta["citations"] == [] and meta["trimmed"]["budget"] == 400
    text = "".join(msgspec.json.decode(data)["text"] for event, data in frames if event == "token")
    assert text == plain["answer"]                        # greedy: the same answer, streamed
    assert done["usage"]["completion"] == 6 and done["finish_reason"] == "length"
    assert done["usage"]["cached"] > 0                    # the same prompt again hit the prefix cache
    assert {row.request_id for row in gateway.ledger.rows()} == {plain["id"], done["id"]}


def test_an_engine_failure_is_reported_and_the_engine_keeps_serving(client, gateway, llm, monkeypatch):
    step, calls = llm.step, [0]

    def failing_step():         # async scheduling: a step's tokens come out of the step after it
        calls[0] += 1
        if calls[0] in (4, 7):
            raise RuntimeError("a simulated fault")
        return step()

    monkeypatch.setattr(llm, "step", failing_step)
    frames = parse_sse(ask(client, max_output_tokens=8, stream=True).text)
    assert [e for e, _ in frames[:3]] == ["meta", "token", "token"] and frames[-1][0] == "error"
    assert "the engine failed while generating" in msgspec.json.decode(frames[-1][1])["error"]["message"]
    r = ask(client, max_output_tokens=8)
    assert r.status_code == 500 and "a simulated fault" in r.json()["error"]["message"]
    assert ask(client, max_output_tokens=4).status_code == 200
    assert [(row.status, row.cost) for row in gateway.ledger.rows()][:2] == [("error", 0.0), ("error", 0.0)]
    assert gateway.ledger.rows()[2].status == "ok"


def test_prefix_cache_entries_are_salted_per_tenant(client):
    question = unique_question(40)                        # more than two full KV blocks
    first = ask(client, "alpha", question=question).json()["usage"]
    again = ask(client, "alpha", question=question).json()["usage"]
    other = ask(client, "beta", question=question).json()["usage"]
    assert first["cached"] == 0 and again["cached"] >= 32
    assert other["cached"] == 0                           # same prompt, other tenant's salt: no reuse


def test_usage_reports_the_callers_month(client, gateway):
    for _ in range(2):
        ask(client, "alpha")
    ask(client, "alpha", mode="large", max_output_tokens=2)
    ask(client, "beta")
    report = client.get("/v1/usage", headers=auth("alpha")).json()
    rows = gateway.ledger.rows("alpha")
    assert report["tenant"] == "alpha" and report["totals"]["requests"] == 3
    assert report["totals"]["completion"] == 10 and report["by_model"]["large"]["requests"] == 1
    assert report["totals"]["cost"] == pytest.approx(sum(r.cost for r in rows))
    assert report["remaining"] == pytest.approx(1000.0 - report["totals"]["cost"])
    old = client.get("/v1/usage?month=2000-01", headers=auth("alpha")).json()
    assert old["month"] == "2000-01" and old["totals"]["requests"] == 0


def test_speculative_decoding_reports_its_acceptance_rate(tmp_path, tmp_path_factory, embedder):
    # A fixed draft cost: whether the engine drafts must not depend on this machine's timing.
    config = msgspec.structs.replace(engine_config(tmp_path_factory),
                                     speculative=SpecConfig("large", "small", draft_cost=0.1, verify_cost=0.05))
    gw = make_gateway(tmp_path, LLMEngine(config, progress=False), embedder)
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        assert ask(c, mode="large", max_output_tokens=16).json()["usage"]["completion"] == 16
        text = c.get("/metrics").text
    assert re.search(r'^sluice_spec_acceptance_rate\{model="large"\} [0-9.e-]+$', text, re.M), text
    assert re.search(r'^sluice_spec_proposed_tokens_total\{model="large"\} [1-9]', text, re.M)
    assert 'sluice_spec_acceptance_rate{model="small"}' not in text
    assert re.search(r'^sluice_spec_governor_arm\{model="large",batch="1",arm="(plain|lookup|lookup\+model)"\} 1$',
                     text, re.M), text
    assert re.search(r'^sluice_spec_governor_goodput\{model="large",batch="1",arm="plain"\} [0-9.e-]+$', text, re.M)
    assert re.search(r'^sluice_spec_draft_seconds_total\{model="large"\} [0-9.e-]+$', text, re.M)
    assert 'sluice_engine_device{model="large",device="cpu"} 1' in text
    assert 'sluice_engine_cuda_graphs{model="small"} 0' in text
    assert 'sluice_engine_dequant_rows{model="small"} 0' in text      # float weights: nothing to dequantize
    assert re.search(r'^sluice_engine_weight_bytes\{model="small",quant="none"\} [1-9][0-9]*$', text, re.M)


# -------------------------------------------------------------- /v1/chat/completions

# The types the OpenAI Python SDK (openai.types.chat) decodes into, with their types kept strict.
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class OAIMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None


class OAIChoice(msgspec.Struct):
    index: int
    message: OAIMessage
    finish_reason: FinishReason
    logprobs: dict | None


class OAIPromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class OAIUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: OAIPromptDetails | None = None


class OAICompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[OAIChoice]
    usage: OAIUsage | None = None


class OAIDelta(msgspec.Struct):
    role: Literal["developer", "system", "user", "assistant", "tool"] | None = None
    content: str | None = None


class OAIChunkChoice(msgspec.Struct):
    index: int
    delta: OAIDelta
    finish_reason: FinishReason | None = None
    logprobs: dict | None = None


class OAIChunk(msgspec.Struct):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[OAIChunkChoice]
    usage: OAIUsage | None = None


def chat(client, tenant="alpha", **body):
    payload = {"model": "auto", "messages": [{"role": "user", "content": "t7 t8"}], "max_tokens": 5, **body}
    return client.post("/v1/chat/completions", json=payload, headers=auth(tenant))


def test_chat_completions_have_openai_shapes(client, gateway):
    messages = [{"role": "system", "content": "t1 t2"}, {"role": "user", "content": unique_question(20)}]
    r = chat(client, messages=messages)
    assert r.status_code == 200
    done = msgspec.json.decode(r.content, type=OAICompletion)
    assert done.model == "small" and len(done.choices) == 1 and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 5 and done.usage.total_tokens == done.usage.prompt_tokens + 5
    assert r.json()["sluice"]["route"]["route_reason"] == "router not installed; tenant default"
    usage = r.json()["usage"]          # one call: it is all that is billed
    assert usage["sluice_billed"] == {"prompt_tokens": done.usage.prompt_tokens, "completion_tokens": 5,
                                      "cached_tokens": done.usage.prompt_tokens_details.cached_tokens,
                                      "reasoning_tokens": 0}

    r = chat(client, messages=messages, stream=True, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = parse_sse(r.text)
    assert all(event is None for event, _ in frames) and frames[-1][1] == "[DONE]"
    chunks = [msgspec.json.decode(data, type=OAIChunk) for _, data in frames[:-1]]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id == f"chatcmpl-{r.headers['x-request-id']}"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    # Without include_usage there is no usage chunk.
    frames = parse_sse(chat(client, stream=True).text)
    assert frames[-1][1] == "[DONE]" and msgspec.json.decode(frames[-2][1], type=OAIChunk).choices
    assert {row.endpoint for row in gateway.ledger.rows()} == {"chat"} and len(gateway.ledger.rows()) == 3


def test_chat_completions_answer_from_a_collection_and_list_models(client):
    assert client.post("/v1/collections/cities/documents", json=DOCS, headers=auth()).status_code == 200
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of Italy?"}]
    r = chat(client, model="large", collection="cities", messages=[{"role": "user", "content": parts}])
    body = r.json()
    msgspec.json.decode(r.content, type=OAICompletion)
    assert body["model"] == "large" and body["sluice"]["trimmed"]["kept"] == 3
    assert {c["doc_id"] for c in body["sluice"]["citations"]} == {"paris", "berlin", "rome"}
    assert client.get("/v1/models", headers=auth()).json() == {"object": "list", "data": [
        {"id": m, "object": "model", "created": 0, "owned_by": "sluice"} for m in ("auto", "small", "large")]}


# --------------------------------------------------------------------- tenant files

def test_tenant_edits_apply_without_restart_and_broken_edits_keep_the_last_good(client, gateway, tmp_path):
    path = tmp_path / "tenants" / "alpha.toml"
    rewrite(path, tenant_toml(KEYS["alpha"], output=8))
    assert ask(client, max_output_tokens=16).status_code == 422
    assert ask(client, max_output_tokens=8).status_code == 200

    rewrite(path, tenant_toml(KEYS["alpha"], output=16).replace("context_budget = 400", 'context_budget = "big"'))
    assert ask(client, max_output_tokens=8).status_code == 200          # the last good version serves
    assert ask(client, max_output_tokens=16).status_code == 422
    assert gateway.tenants.errors["alpha.toml"] == f"{path}: field 'context_budget': expected int, got str"
    metrics = client.get("/metrics").text
    assert 'sluice_tenant_file_error{file="alpha.toml"} 1' in metrics
    assert 'sluice_tenant_reloads_total{result="error"} 1' in metrics

    rewrite(tmp_path / "tenants" / "gamma.toml", tenant_toml("sk-gamma").replace("[limits]", "[limits"))
    r = client.post("/v1/ask", json={"question": "t1"}, headers={"Authorization": "Bearer sk-gamma"})
    assert r.status_code == 401                                              # a new file, broken: not loaded
    assert "not valid TOML" in gateway.tenants.errors["gamma.toml"]
    rewrite(path, tenant_toml("sk-rotated", output=16))                      # fixed, with a new key
    assert ask(client, max_output_tokens=16).status_code == 401              # the old key is gone
    r = client.post("/v1/ask", json={"question": "t1", "max_output_tokens": 16},
                    headers={"Authorization": "Bearer sk-rotated"})
    assert r.status_code == 200 and "alpha.toml" not in gateway.tenants.errors
    assert 'sluice_tenant_file_error{file="alpha.toml"}' not in client.get("/metrics").text
    (tmp_path / "tenants" / "beta.toml").unlink()                            # a removed file removes its tenant
    gateway.tenants.refresh(force=True)
    assert ask(client, "beta").status_code == 401


TENANT_ERRORS = [
    ("context_budget = 400\n", "", "field 'context_budget' is required but missing"),
    ("requests_per_minute = 10000", 'requests_per_minute = "many"',
     "field 'limits.requests_per_minute': expected int, got str"),
    ("output_budget = 32", "output_budget = 0", "field 'output_budget': expected int >= 1"),
    ('api_key_sha256 = ["', 'api_key_sha256 = ["zz', "field 'api_key_sha256[0]': expected str matching regex"),
    ("[limits]", "colour = 'blue'\n[limits]", "field 'colour' is not a known field"),
    ("[limits]", "[limits", "not valid TOML"),
    ('allowed_models = ["small", "large"]', 'allowed_models = ["small", "xl"]',
     "field 'allowed_models': 'xl' not served; expected a subset of ['large', 'small']"),
    ('default_model = "small"', 'default_model = "medium"', "field 'default_model': expected one of allowed_models"),
    ('prefix_cache_salt = "salt-sk-test-alpha"', 'prefix_cache_salt = "short"',
     "field 'prefix_cache_salt': expected str of length >= 8"),
    ("monthly_spend_cap_usd = 1000.0", "monthly_spend_cap_usd = -1.0",
     "field 'limits.monthly_spend_cap_usd': expected float >= 0"),
    ("[limits]", "[router]\nclosed_book_arm_margin = 1.5\n[limits]",
     "field 'router.closed_book_arm_margin': expected float <= 1.0"),
    ("[limits]", "[thinking_budget.exit]\nevery = 0\n[limits]",
     "field 'thinking_budget.exit.every': must be >= 1 (thinking tokens between probes), got 0"),
    ("[limits]", "[thinking_budget.exit]\nconfidence = 1.0\n[limits]",
     "field 'thinking_budget.exit.confidence': must be in (0, 1), got 1.0"),
]


@pytest.mark.parametrize("old,new,message", TENANT_ERRORS)
def test_a_bad_tenant_file_is_refused_naming_file_field_and_expectation(tmp_path, old, new, message):
    text = tenant_toml(KEYS["alpha"])
    assert old in text
    path = tmp_path / "alpha.toml"
    path.write_text(text.replace(old, new))
    with pytest.raises(ConfigError) as e:
        load_tenant(path, {"small", "large"})
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_tenant_ids_come_from_file_names_and_keys_are_unique(tmp_path):
    (tmp_path / "Bad Name.toml").write_text(tenant_toml("sk-1"))
    (tmp_path / "one.toml").write_text(tenant_toml("sk-shared"))
    (tmp_path / "two.toml").write_text(tenant_toml("sk-shared"))
    tenants, errors = check_folder(tmp_path, {"small", "large"})
    assert [t.id for t in tenants] == ["one"]
    assert "file name is the tenant id" in errors["Bad Name.toml"]
    assert "a key is already used by tenant one" in errors["two.toml"]


def test_the_example_tenant_file_is_valid():
    tenants, errors = check_folder("examples/tenants", {"small", "large"})
    assert errors == {} and [t.id for t in tenants] == ["demo"]
    assert tenants[0].spec.api_key_sha256 == [hashlib.sha256(b"sk-sluice-demo").hexdigest()]
    policy = tenants[0].terms.policy
    assert (policy.arm_margin, policy.closed_book_margin, policy.widen) == (0.05, None, True)   # unset: arm_margin
    assert not policy.widen_from_cache
    assert tenants[0].terms.thinking_exit is None       # early exit is off until a tenant turns it on


def test_a_tenant_sets_its_closed_book_arm_margin_and_widening_order(tmp_path):
    path = tmp_path / "alpha.toml"
    path.write_text(tenant_toml(KEYS["alpha"]).replace("[limits]", "[router]\narm_margin = 0.2\n"
                                                                    "closed_book_arm_margin = 0.05\n"
                                                                    "widen_from_cache = true\n[limits]"))
    policy = load_tenant(path, {"small", "large"}).terms.policy
    assert ((policy.arm_margin, policy.closed_book_margin, policy.widen, policy.widen_from_cache)
            == (0.2, 0.05, True, True))


# --------------------------------------------------------------------------- limits

def test_request_rate_limit_answers_429_with_retry_after(tmp_path, llm, embedder):
    gw = make_gateway(tmp_path, llm, embedder, {"alpha": tenant_toml(KEYS["alpha"], rpm=3)})
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        assert [ask(c).status_code for _ in range(3)] == [200, 200, 200]
        r = ask(c)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "limit of 3 requests per minute" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert len(gw.ledger.rows()) == 3


def test_token_rate_limit_reserves_the_worst_case_and_answers_429(tmp_path, llm, embedder):
    gw = make_gateway(tmp_path, llm, embedder, {"alpha": tenant_toml(KEYS["alpha"], tpm=60)})
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        first = ask(c, max_output_tokens=30).json()          # about 36 of the 60 tokens a minute
        assert first["usage"]["completion"] == 30
        r = ask(c, max_output_tokens=30)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "limit of 60 tokens per minute" in r.json()["error"]["message"]
        assert ask(c, max_output_tokens=4).status_code == 200   # a smaller request still fits
    assert len(gw.ledger.rows()) == 2


def test_spend_cap_refuses_on_the_estimate_and_settles_real_cost(tmp_path, llm, embedder):
    cap = 0.2
    gw = make_gateway(tmp_path, llm, embedder, {"alpha": tenant_toml(KEYS["alpha"], cap=cap)})
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        statuses = []
        while len(statuses) < 30 and 402 not in statuses:
            statuses.append(ask(c, max_output_tokens=30).status_code)
        assert statuses[:2] == [200, 200] and statuses[-1] == 402
        r = ask(c, max_output_tokens=30)
        assert r.status_code == 402 and f"monthly cap of ${cap:.2f}" in r.json()["error"]["message"]
        spent = sum(row.cost for row in gw.ledger.rows())
        assert spent <= cap                                   # the cap holds: refusals use the worst case
        report = c.get("/v1/usage", headers=auth()).json()
        assert report["remaining"] == pytest.approx(cap - spent)
        # What is left still pays for a request whose worst case fits it.
        prompt = gw.ledger.rows()[0].prompt_tokens
        if cap - spent >= (prompt * 1000 + 2000) / 1e6:
            assert ask(c, max_output_tokens=1).status_code == 200
        nothing = make_gateway(tmp_path / "zero", llm, embedder, {"alpha": tenant_toml(KEYS["alpha"], cap=0.0)})
    with TestClient(create_app(nothing)) as c:
        wait_ready(c)
        r = ask(c)
        assert r.status_code == 402 and "has spent its monthly cap of $0.00" in r.json()["error"]["message"]
    assert nothing.ledger.rows() == []


def test_the_bounded_queue_answers_503_when_full(tmp_path, llm, embedder):
    gw = make_gateway(tmp_path, llm, embedder, max_inflight=1, max_queued=1)
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        portal = c.blocking_portal                         # the app's own event loop
        holder = gw.run(gw.tenants.get("beta"), Query("t1", "ask", max_output_tokens=4))
        portal.call(anext, holder)                         # past Meta: it holds the only engine slot
        queued = []
        waiter = threading.Thread(target=lambda: queued.append(ask(c)))
        waiter.start()
        while gw.admission.waiting < 1:
            time.sleep(0.005)
        r = ask(c)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "at capacity (1 generating, 1 queued)" in r.json()["error"]["message"]
        portal.call(holder.aclose)                         # the slot frees; the queued request runs
        waiter.join()
        assert queued[0].status_code == 200
    assert [row.tenant for row in gw.ledger.rows()] == ["alpha"]
