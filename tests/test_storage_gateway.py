"""Gateways on PostgreSQL and Redis: the gateway's own limit tests run again on shared
storage, and two replicas (two gateways, each with its own engine, over real HTTP) hold one
tenant's spend cap and rate limit together under 40 concurrent clients."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import tests.test_gateway as gateway_tests
from engine.llm_engine import LLMEngine
from tests.services import Postgres, Redis, server
from tests.test_gateway_support import KEYS, Server, auth, embedder, engine_config, llm, make_gateway, tenant_toml  # noqa: F401


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def on_shared_storage(monkeypatch):
    """Every gateway the test builds gets a fresh PostgreSQL database and Redis database."""
    postgres, redis = server(Postgres), server(Redis)
    numbers = iter(range(16))

    def shared(*args, **config):
        return make_gateway(*args, ledger=postgres.fresh_database(), limits=redis.fresh_database(next(numbers)),
                            **config)
    monkeypatch.setattr(gateway_tests, "make_gateway", shared)


CASES = [gateway_tests.test_request_rate_limit_answers_429_with_retry_after,
         gateway_tests.test_token_rate_limit_reserves_the_worst_case_and_answers_429,
         gateway_tests.test_spend_cap_refuses_on_the_estimate_and_settles_real_cost,
         gateway_tests.test_the_bounded_queue_answers_503_when_full]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__.removeprefix("test_"))
def test_the_gateway_limit_tests_pass_on_postgres_and_redis(case, on_shared_storage, tmp_path, llm, embedder):
    case(tmp_path, llm, embedder)


RPM, CAP, CLIENTS, SECONDS = 30, 0.25, 40, 6.0


@pytest.mark.anyio
async def test_two_replicas_hold_one_cap_and_one_rate_limit_for_40_clients(tmp_path, tmp_path_factory, llm,
                                                                         embedder):
    postgres, redis = server(Postgres).fresh_database(), server(Redis).fresh_database()
    alpha = {"alpha": tenant_toml(KEYS["alpha"], rpm=RPM, cap=CAP)}
    engines = [llm, LLMEngine(engine_config(tmp_path_factory), progress=False)]   # each replica owns one
    replicas = [make_gateway(tmp_path / f"replica{i}", engine, embedder, alpha, ledger=postgres, limits=redis,
                             max_inflight=16, max_queued=4 * CLIENTS) for i, engine in enumerate(engines)]
    results: list[tuple[int, int, str | None]] = []          # (replica, status, request id)
    with Server(replicas[0]) as one, Server(replicas[1]) as two:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=CLIENTS)) as client:
            start = time.monotonic()

            async def user(i: int) -> None:
                url = (one, two)[i % 2].url
                while time.monotonic() < start + SECONDS:
                    r = await client.post(f"{url}/v1/ask", json={"question": "t1 t2 t3", "max_output_tokens": 4},
                                          headers=auth("alpha"))
                    results.append((i % 2, r.status_code, r.json().get("id")))
                    if r.status_code != 200:
                        await asyncio.sleep(0.05)            # a refused client waits a little, as told

            await asyncio.gather(*(user(i) for i in range(CLIENTS)))
            elapsed = time.monotonic() - start
    statuses = [status for _, status, _ in results]
    assert set(statuses) == {200, 402, 429}, {s: statuses.count(s) for s in set(statuses)}
    # The rate limit: a bucket of RPM that refills at RPM a minute, shared by both replicas.
    admitted = [replica for replica, status, _ in results if status != 429]
    assert RPM <= len(admitted) <= RPM + RPM * elapsed / 60 and set(admitted) == {0, 1}
    # The cap: what the ledger recorded never passes it; every 2xx has exactly one row.
    rows = replicas[0].ledger.rows()
    assert sum(row.cost for row in rows) <= CAP
    answered = [rid for _, status, rid in results if status == 200]
    assert sorted(row.request_id for row in rows) == sorted(answered) and len(set(answered)) == len(answered)
    assert {row.status for row in rows} == {"ok"}
