"""Graceful shutdown on a real uvicorn server: the first SIGTERM (here handed to the server as
its signal handler would be) stops admitting (503 shutting_down, /readyz 503), lets what was
admitted finish for up to drain_timeout_s, cuts the rest with a clear error (a 503, or a
stream's final error event), writes one ledger row for every request that reached the
engine, frees every KV block, and the server exits."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import msgspec

from tests.test_gateway_support import (  # noqa: F401
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

LONG = {"alpha": tenant_toml(KEYS["alpha"], output=400, salt="salt-shutdown")}


def _stream(url: str, tokens: int, out: list) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/ask", json={"question": "t1 t2", "max_output_tokens": tokens, "stream": True}, headers=auth())
        out.append(parse_sse(r.text))


def test_a_drain_finishes_what_it_admitted_and_refuses_what_comes_after(tmp_path, slow_llm, embedder):
    gw = make_gateway(tmp_path, slow_llm, embedder, LONG, drain_timeout_s=30.0)
    frames: list = []
    with Server(gw) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        reader = threading.Thread(target=_stream, args=(server.url, 200, frames))
        reader.start()
        wait_for(lambda: slow_llm.requests)                 # generating: now the signal
        server.server.handle_exit(signal.SIGTERM, None)
        wait_for(lambda: gw.draining)
        late = c.post("/v1/ask", json={"question": "t3", "max_output_tokens": 2}, headers=auth())
        ready = c.get("/readyz")
        reader.join(timeout=60)
        server.thread.join(timeout=30)
        assert not server.thread.is_alive()                  # drained, then it stopped by itself
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down" and late.headers["retry-after"]
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    [events] = frames
    assert events[0][0] == "meta" and events[-1][0] == "done"        # finished within the drain
    assert [(row.status, row.completion_tokens) for row in gw.ledger.rows()] == [("ok", 200)]


def test_past_the_drain_timeout_what_is_left_is_cut_with_a_clear_error_and_billed(tmp_path, slow_llm, embedder):
    gw = make_gateway(tmp_path, slow_llm, embedder, LONG, drain_timeout_s=0.2)
    frames: list = []
    answers: list = []
    with Server(gw) as server:
        readers = [threading.Thread(target=_stream, args=(server.url, 400, frames)) for _ in range(2)]
        readers.append(threading.Thread(target=lambda: answers.append(httpx.post(
            f"{server.url}/v1/ask", json={"question": "t4 t5", "max_output_tokens": 400}, headers=auth(),
            timeout=60))))
        for t in readers:
            t.start()
        wait_for(lambda: len(slow_llm.requests) == 3)
        server.server.handle_exit(signal.SIGTERM, None)
        for t in readers:
            t.join(timeout=60)
        server.thread.join(timeout=30)
        assert not server.thread.is_alive()
    for events in frames:             # 400 tokens take over a second: the 0.2 s drain cut them
        assert events[0][0] == "meta" and events[-1][0] == "error"
        assert msgspec.json.decode(events[-1][1])["error"]["code"] == "shutting_down"
    [r] = answers
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    rows = gw.ledger.rows()
    assert len(rows) == 3 and all(row.status == "cancelled" and 0 < row.completion_tokens < 400 and row.cost > 0
                                  for row in rows)
    assert not slow_llm.requests
    assert all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in slow_llm.stats().values())
