"""The gateway as a real uvicorn server on 127.0.0.1, driven by httpx: every endpoint over
HTTP, streaming as it happens, clients that go away, and many clients at once."""
from __future__ import annotations

import asyncio
import random
import socket
import time

import httpx
import msgspec
import pytest

from tests.test_gateway_support import (  # noqa: F401
    DOCS,
    KEYS,
    Server,
    auth,
    embedder,
    llm,
    make_gateway,
    parse_sse,
    slow_llm,
    tenant_toml,
    wait_for,
)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_every_endpoint_over_http(tmp_path, llm, embedder):
    gw = make_gateway(tmp_path, llm, embedder)
    with Server(gw) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/healthz").json()["status"] == "ok"
        assert c.get("/readyz").status_code == 200
        assert c.get("/schema/openapi.json").json()["info"]["title"] == "Sluice"
        assert c.post("/v1/collections/cities/documents", json=DOCS, headers=auth()).json()["chunks"] == 3
        body = c.post("/v1/ask", json={"question": "capital of Italy?", "collection": "cities"}, headers=auth()).json()
        assert body["usage"]["completion"] == 32 and len(body["citations"]) == 3
        # Streamed: the meta event comes before the tokens, and each token as it is made.
        with c.stream("POST", "/v1/ask", json={"question": "t1 t2", "stream": True}, headers=auth()) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            text = "".join(r.iter_text())
        frames = parse_sse(text)
        assert [e for e, _ in frames] == ["meta"] + ["token"] * 32 + ["done"]
        chat = {"model": "large", "messages": [{"role": "user", "content": "t3"}], "max_tokens": 3}
        assert c.post("/v1/chat/completions", json=chat, headers=auth()).json()["object"] == "chat.completion"
        frames = parse_sse(c.post("/v1/chat/completions", json={**chat, "stream": True}, headers=auth()).text)
        assert frames[-1] == (None, "[DONE]") and len(frames) == 1 + 3 + 1 + 1
        assert [m["id"] for m in c.get("/v1/models", headers=auth()).json()["data"]] == ["auto", "small", "large"]
        assert c.delete("/v1/collections/cities/documents/rome", headers=auth()).json()["deleted_chunks"] == 1
        assert c.get("/v1/collections", headers=auth()).json()["collections"][0]["documents"] == 2
        assert c.get("/v1/usage", headers=auth()).json()["totals"]["requests"] == 4
        assert "sluice_http_requests_total" in c.get("/metrics").text
        assert c.post("/v1/ask", json={"question": 1}, headers=auth()).status_code == 422
    assert len(gw.ledger.rows()) == 4


LONG = {"alpha": tenant_toml(KEYS["alpha"], output=400)}


@pytest.mark.parametrize("endpoint", ["ask", "chat"])
def test_a_client_leaving_mid_stream_cancels_its_generation_and_frees_its_blocks(tmp_path, slow_llm, embedder,
                                                                                   endpoint):
    llm = slow_llm
    gw = make_gateway(tmp_path, llm, embedder, LONG)
    url, payload = {
        "ask": ("/v1/ask", {"question": "t1 t2", "max_output_tokens": 400, "stream": True}),
        "chat": ("/v1/chat/completions", {"model": "auto", "messages": [{"role": "user", "content": "t1"}],
                                          "max_tokens": 400, "stream": True})}[endpoint]
    with Server(gw) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", url, json=payload, headers=auth()) as r:
            lines = r.iter_lines()      # held: an abandoned iterator would close the connection
            for line in lines:          # read until a token has arrived
                if line.startswith('data: {"text"') or '"delta":{"content":' in line:
                    break
            assert llm.requests         # it is still generating; now hang up
        wait_for(lambda: gw.ledger.rows())
        [row] = gw.ledger.rows()
        assert row.status == "cancelled" and 0 < row.completion_tokens < 400 and row.finish_reason == "abort"
        wait_for(lambda: not llm.requests)
        stats = llm.stats()["small"]
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == 0
        assert c.post("/v1/ask", json={"question": "t1", "max_output_tokens": 2}, headers=auth()).status_code == 200


def test_a_client_leaving_before_its_answer_cancels_its_generation(tmp_path, slow_llm, embedder):
    llm = slow_llm
    gw = make_gateway(tmp_path, llm, embedder, LONG)
    with Server(gw) as server:
        host, port = server.url.removeprefix("http://").split(":")
        body = msgspec.json.encode({"question": "t1 t2", "max_output_tokens": 400})
        request = (f"POST /v1/ask HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEYS['alpha']}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request)
            wait_for(lambda: llm.requests)             # generating; now hang up without reading
        wait_for(lambda: gw.ledger.rows())
        [row] = gw.ledger.rows()
        assert row.status == "cancelled" and row.completion_tokens < 400
        wait_for(lambda: not llm.requests)
        assert all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in llm.stats().values())


def test_a_client_leaving_mid_prefill_cancels_its_request_before_the_prefill_ends(tmp_path, llm, embedder,
                                                                                   monkeypatch):
    """A long prompt prefilled 16 tokens a step, each step slowed: a client that hangs up while
    it is being prefilled has it cut there (not after the prompt's KV is built), its blocks
    back, and a ledger row that bills the prompt and no output."""
    gw = make_gateway(tmp_path, llm, embedder, LONG)
    monkeypatch.setattr(llm.worker("small").scheduler, "max_num_batched_tokens", 16)
    step = llm.step
    monkeypatch.setattr(llm, "step", lambda: (time.sleep(0.02), step())[1])
    with Server(gw) as server:
        host, port = server.url.removeprefix("http://").split(":")
        chat = {"model": "small", "max_tokens": 8,
                "messages": [{"role": "user", "content": " ".join(f"t{i % 9}" for i in range(300))}]}
        body = msgspec.json.encode(chat)
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEYS['alpha']}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request)
            wait_for(lambda: any(seq.num_computed_tokens for _, seq in llm.requests.values()))
            [(_, seq)] = llm.requests.values()
            assert len(seq.token_ids) > 160              # ten steps of prefill at least
        wait_for(lambda: not llm.requests)
        assert seq.num_computed_tokens < seq.num_prompt_tokens == len(seq.token_ids)   # no token made
        wait_for(lambda: gw.ledger.rows())
        [row] = gw.ledger.rows()
        assert row.status == "cancelled" and row.completion_tokens == 0 and row.prompt_tokens == seq.num_prompt_tokens
        assert all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in llm.stats().values())


# ------------------------------------------------------------------ many clients

async def one_request(client: httpx.AsyncClient, kind: str, tenant: str) -> tuple[int, str | None]:
    """Sends one request of a kind; returns its status and, when answered, its request id."""
    question = random.choice(["What is the capital of France?", "t1 t2 t3", "Which city has the Colosseum?"])
    chat = {"model": random.choice(["auto", "small", "large"]), "max_tokens": 8,
            "messages": [{"role": "user", "content": question}]}
    ask = {"question": question, "max_output_tokens": 8, "mode": random.choice(["auto", "small", "large"])}
    if kind == "ask-rag":
        ask["collection"] = "cities"
    if kind in ("ask", "ask-rag"):
        r = await client.post("/v1/ask", json=ask, headers=auth(tenant))
        return r.status_code, r.json().get("id") if r.status_code == 200 else None
    if kind == "chat":
        r = await client.post("/v1/chat/completions", json=chat, headers=auth(tenant))
        return r.status_code, r.json()["id"].removeprefix("chatcmpl-") if r.status_code == 200 else None
    url, payload = ("/v1/ask", {**ask, "stream": True}) if kind == "ask-stream" else \
        ("/v1/chat/completions", {**chat, "stream": True})
    async with client.stream("POST", url, json=payload, headers=auth(tenant)) as r:
        text = "".join([chunk async for chunk in r.aiter_text()])
    if r.status_code != 200:
        return r.status_code, None
    last = parse_sse(text)[-1]
    assert last[0] == "done" or last[1] == "[DONE]", text[-300:]
    return 200, r.headers["x-request-id"]


@pytest.mark.anyio
@pytest.mark.parametrize("clients,seconds", [(20, 5), pytest.param(50, 60, marks=pytest.mark.slow)])
async def test_concurrent_clients_get_answers_and_exactly_one_ledger_row_each(tmp_path, llm, embedder, clients,
                                                                              seconds):
    gw = make_gateway(tmp_path, llm, embedder, max_inflight=16, max_queued=4 * clients)
    kinds = ["ask", "ask-rag", "ask-stream", "chat", "chat-stream"]
    with Server(gw) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=clients)) as client:
            for tenant in KEYS:
                r = await client.post("/v1/collections/cities/documents", json=DOCS, headers=auth(tenant))
                assert r.status_code == 200
            deadline = time.monotonic() + seconds
            results: list[tuple[int, str | None]] = []

            async def user(i: int) -> None:
                n = 0
                while time.monotonic() < deadline:
                    results.append(await one_request(client, kinds[(i + n) % len(kinds)], "alpha" if i % 2 else "beta"))
                    n += 1

            await asyncio.gather(*(user(i) for i in range(clients)))
    statuses = [s for s, _ in results]
    assert all(s < 500 for s in statuses), sorted(set(statuses))
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    answered = [rid for _, rid in results]
    rows = gw.ledger.rows()
    assert len(rows) == len(answered) == len(set(answered)) >= clients
    assert {r.request_id for r in rows} == set(answered) and {r.status for r in rows} == {"ok"}
