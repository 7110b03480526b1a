"""Deadlines: a request past its tenant's request_timeout_s is cut in the engine (its KV blocks
back at once), answered 504 (a stream: a final error event), and billed for what it produced
in a ledger row with status timeout; admission refuses at once (503, Retry-After) what the
queue's pace says could not start in time. The engine is 3 ms slower a step (slow_llm), so a
400-token answer of the tiny models takes over a second, well past a 0.3 s deadline."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from gateway.errors import GatewayError
from gateway.http.app import create_app
from gateway.usage.limits import Admission
from tests.test_gateway_support import (  # noqa: F401
    KEYS,
    auth,
    embedder,
    llm,
    make_gateway,
    parse_sse,
    slow_llm,
    tenant_toml,
    wait_ready,
)


def _toml(timeout: float) -> str:
    return tenant_toml(KEYS["alpha"], output=400, salt="salt-deadlines") + f"request_timeout_s = {timeout}\n"


def test_a_request_past_its_deadline_is_cut_answered_504_and_billed_for_what_it_made(tmp_path, slow_llm, embedder):
    slow = slow_llm
    from litestar.testing import TestClient
    gw = make_gateway(tmp_path, slow, embedder, {"alpha": _toml(0.3)})
    free = {name: s["kv_blocks_free"] for name, s in slow.stats().items()}
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        started = time.monotonic()
        r = c.post("/v1/ask", json={"question": "t5 t6 t7", "max_output_tokens": 400}, headers=auth())
        took = time.monotonic() - started
        streamed = c.post("/v1/ask", json={"question": "t5 t6 t8", "max_output_tokens": 400, "stream": True},
                          headers=auth())
        chat = c.post("/v1/chat/completions", json={"model": "small", "max_tokens": 400,
                                                    "messages": [{"role": "user", "content": "t5 t6 t9"}]},
                      headers=auth())
    # 400 tokens take over 1.2 s; the deadline cut it at 0.3 s.
    assert r.status_code == 504 and took < 1.2, r.text
    error = r.json()["error"]
    assert error["code"] == "deadline_exceeded" and "0.3 s" in error["message"]
    frames = parse_sse(streamed.text)
    assert streamed.status_code == 200 and frames[0][0] == "meta" and frames[-1][0] == "error"
    assert msgspec.json.decode(frames[-1][1])["error"]["code"] == "deadline_exceeded"
    assert chat.status_code == 504 and chat.json()["error"]["code"] == "deadline_exceeded"
    rows = gw.ledger.rows()
    assert [row.status for row in rows] == ["timeout"] * 3
    for row in rows:              # billed for the tokens it made, and no more than the deadline allowed
        assert 0 < row.completion_tokens < 400 and row.cost > 0 and row.finish_reason == "abort"
    assert {name: s["kv_blocks_free"] for name, s in slow.stats().items()} == free
    assert not slow.requests


def test_a_request_within_its_deadline_is_answered_as_before(tmp_path, slow_llm, embedder):
    from litestar.testing import TestClient
    gw = make_gateway(tmp_path, slow_llm, embedder, {"alpha": _toml(30.0)})
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        r = c.post("/v1/ask", json={"question": "t5 t6 t7", "max_output_tokens": 8}, headers=auth())
    assert r.status_code == 200 and r.json()["usage"]["completion"] == 8
    assert gw.ledger.rows()[0].status == "ok"


def test_admission_refuses_what_could_not_start_in_time_and_gives_up_waiting_at_the_deadline():
    async def scenario():
        admission = Admission(slots=1, queue=4)
        held = asyncio.Event()

        async def hold(seconds: float):
            async with admission.slot():
                held.set()
                await asyncio.sleep(seconds)

        holder = asyncio.create_task(hold(0.3))
        await held.wait()
        # No pace measured yet: it queues, and gives up at its deadline with nothing run.
        with pytest.raises(GatewayError) as late:
            async with admission.slot(time.monotonic() + 0.1):
                pytest.fail("it got a slot past its deadline")
        await holder
        assert (late.value.status, late.value.code) == (504, "deadline_exceeded")
        assert admission.held_s == pytest.approx(0.2 * 0.3, abs=0.03)        # the first hold, averaged in
        admission.held_s = 10.0             # the pace: a slot is held 10 s
        held.clear()
        holder = asyncio.create_task(hold(0.05))
        await held.wait()
        with pytest.raises(GatewayError) as busy:          # 10 s of queue ahead, a 2 s deadline
            async with admission.slot(time.monotonic() + 2.0):
                pytest.fail("admitted a request that could not start in time")
        assert (busy.value.status, busy.value.code) == (503, "overloaded")
        assert float(busy.value.headers["Retry-After"]) >= 10
        async with admission.slot(time.monotonic() + 60.0) as queued:      # 10 s ahead fits in 60
            assert queued < 1.0
        await holder
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())
