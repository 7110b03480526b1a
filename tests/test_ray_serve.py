"""Sluice as replicas on Ray Serve, on this machine: one local Ray instance for the module
(loopback only), two replicas of a tiny random model, PostgreSQL and Redis from the system
packages. Slow (Ray and every replica start in tens of seconds): `make test-ray`.

- Affinity: 20 questions on one collection, five topics asked in turn, through two replicas
  whose KV cache holds about three topics' passages each: the affine router keeps a topic
  on one replica, round robin makes each replica cycle through all five. The hit rate is
  cached prompt tokens over prompt tokens, as the engines counted them.
- A rolling update under load: the old replicas drain, no request fails.
- A replica killed by its process id under load: every answered request has its ledger row,
  Serve starts a new replica, and only requests the dead one held fail, with a 503 that says so.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from engine.config import EngineConfig, ModelEntry
from gateway.config import Price, ReplicaConfig, ServerConfig
from retrieval import CollectionStore, Document, Embedder
from tests.conftest import make_tiny_model
from tests.services import Postgres, Redis, free_port, server
from tests.test_gateway_support import KEYS, _no_eos, auth, tenant_toml

pytestmark = pytest.mark.slow
TOPICS, QUESTIONS, WORDS = 5, 20, 60


def start_ray() -> str:
    """A local Ray with Serve's HTTP proxy on a free loopback port; its URL."""
    import ray
    from ray import serve
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray import serve
    yield start_ray()
    serve.shutdown()
    ray.shutdown()


def make_site(root: Path, kv_blocks: int) -> tuple[EngineConfig, Path, Path]:
    """A tiny model with `kv_blocks` KV blocks of 16 tokens, a tenants folder, and a data folder
    holding collection 'topics': one passage of 60 words per topic, each topic its own words."""
    small = _no_eos(make_tiny_model(root / "small", "qwen2", seed=1))
    engine = EngineConfig(models={"small": ModelEntry(str(small))}, block_size=16, max_kv_blocks=kv_blocks,
                          memory_budget_gb=1.0, num_threads=1)
    (root / "tenants").mkdir()
    (root / "tenants" / "alpha.toml").write_text(tenant_toml(KEYS["alpha"], context=WORDS + 60, output=96,
                                                                 allowed=("small",)))
    store = CollectionStore(root / "data" / "collections", Embedder(device="cpu"))
    store.collection("alpha", "topics").ingest([Document(id=f"topic{t}", title="", text=" ".join(
        topic_words(t)[i % 20] for i in range(WORDS))) for t in range(TOPICS)])
    store.close()
    return engine, root / "tenants", root / "data"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[EngineConfig, Path, Path]:
    """A KV cache that holds about three topics' prompts: two replicas hold all five between them."""
    return make_site(tmp_path_factory.mktemp("ray"), kv_blocks=16)


def topic_words(t: int) -> list[str]:
    return [f"t{t * 20 + i + 1}" for i in range(20)]


def deploy(site, config: ServerConfig | None = None, **replicas) -> ServerConfig:
    """Two replicas on a fresh PostgreSQL and Redis database, or on `config`'s; a second call
    replaces the first deployment (and its replicas, with cold caches)."""
    from ray import serve

    from gateway.scale.serve_ray import application
    engine, tenants, data = site
    config = config or ServerConfig(
        engine=engine, prices={"small": Price(input=1000.0, cached_input=250.0, output=2000.0)},
        ledger=server(Postgres).fresh_database(), limits=server(Redis).fresh_database(),
        replicas=ReplicaConfig(**{"min": 2, "max": 2, "cpus": 1, **replicas}), tenant_reload_interval_s=0.0)
    serve.run(application(config, tenants, data), name="sluice", route_prefix="/")
    return config


def hit_rate(url: str) -> float:
    """Ask the 20 questions one after another; the share of prompt tokens the replicas' prefix
    caches served, from each replica's metrics (one series per replica), checked against the
    engines' own block counters."""
    for t in range(QUESTIONS):                 # topics in turn: 0 1 2 3 4 0 1 ...
        topic, n = t % TOPICS, t // TOPICS
        question = " ".join(topic_words(topic)[(3 * n + j) % 20] for j in range(4))
        r = httpx.post(f"{url}/v1/ask", json={"question": question, "collection": "topics", "max_output_tokens": 4},
                       headers=auth("alpha"), timeout=60)
        assert r.status_code == 200, r.text
        assert [c["doc_id"] for c in r.json()["citations"]] == [f"topic{topic}"]
    tokens: dict[tuple[str, str], float] = {}
    for replica, kind, value in re.findall(r'^sluice_tokens_total\{replica="(\w+)",tenant="alpha",model="small",'
                                           r'kind="(prompt|cached)"\} (\S+)$', httpx.get(f"{url}/metrics").text, re.M):
        tokens[replica, kind] = float(value)
    replicas = httpx.get(f"{url}/replicas").json()
    assert {replica for replica, _ in tokens} == {r["replica"] for r in replicas} and len(replicas) == 2
    cached = sum(v for (_, kind), v in tokens.items() if kind == "cached")
    assert cached == 16 * sum(r["engine"]["small"]["prefix_cache_hits"] for r in replicas)
    return cached / sum(v for (_, kind), v in tokens.items() if kind == "prompt")


def test_the_affine_router_makes_half_again_as_many_cache_hits_as_round_robin(cluster, site):
    rates = {}
    for routing in ("round_robin", "affinity"):
        deploy(site, routing=routing)                # fresh replicas: cold caches
        rates[routing] = hit_rate(cluster)
    assert rates["affinity"] >= 1.5 * rates["round_robin"], rates
    router = httpx.get(f"{cluster}/metrics").text      # affinity's own account: each topic new once
    assert re.search(r'^sluice_router_requests_total\{ingress="\w+",outcome="affine"\} 15$', router, re.M)
    assert re.search(r'^sluice_router_requests_total\{ingress="\w+",outcome="new"\} 5$', router, re.M)


CLIENTS, LOAD_S, KILL_AT_S = 8, 12.0, 4.0


def ask_in_turn(i: int, n: int, tokens: int = 32) -> dict:
    topic = (i + n) % TOPICS
    return {"question": " ".join(topic_words(topic)[(i + n + j) % 20] for j in range(4)), "collection": "topics",
            "max_output_tokens": tokens}


def ledger_ids(config: ServerConfig) -> list[str]:
    import psycopg
    with psycopg.connect(config.ledger) as db:
        return [rid for (rid,) in db.execute("SELECT request_id FROM requests")]


def test_a_rolling_update_under_load_drains_the_old_replicas_and_fails_no_request(cluster, site):
    """A new deployment while 8 clients keep asking: Serve starts new replicas and drains the old
    ones (no new requests, the held ones finished), so every request is answered, once billed."""
    config = deploy(site)
    before = {r["replica"] for r in httpx.get(f"{cluster}/replicas").json()}
    results: list[tuple[int, dict]] = []

    async def load() -> None:
        updated = asyncio.Event()
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as client:
            async def user(i: int) -> None:
                n = 0
                while not updated.is_set():
                    r = await client.post("/v1/ask", headers=auth("alpha"), json=ask_in_turn(i, n))
                    results.append((r.status_code, r.json()))
                    n += 1

            async def update() -> None:
                await asyncio.sleep(2)
                new = msgspec.structs.replace(config, drain_timeout_s=config.drain_timeout_s + 1)
                await asyncio.to_thread(deploy, site, new)      # returns once the new replicas serve
                await asyncio.sleep(3)                         # and the old ones are draining
                updated.set()

            await asyncio.gather(update(), *(user(i) for i in range(CLIENTS)))

    asyncio.run(load())
    assert len(results) > 2 * CLIENTS and [s for s, _ in results if s != 200] == [], \
        [b for s, b in results if s != 200][:3]
    rows = ledger_ids(config)
    assert len(rows) == len(set(rows)) and {body["id"] for _, body in results} <= set(rows)
    after = {r["replica"] for r in httpx.get(f"{cluster}/replicas").json()}
    assert len(after) == 2 and not after & before, (before, after)


def test_a_killed_replica_loses_no_answered_row_and_fails_only_what_it_held(cluster, site):
    config = deploy(site)
    results: list[tuple[float, float, int, dict, str | None]] = []   # start, end, status, body, replica
    before: dict[str, int] = {}
    victim = ""

    async def load() -> float:
        async with httpx.AsyncClient(base_url=cluster, timeout=120) as client:
            start = time.monotonic()

            async def user(i: int) -> None:
                n = 0
                while time.monotonic() < start + LOAD_S:
                    began = time.monotonic()
                    # Long answers: a request outlives the moment between seeing the victim busy and the kill.
                    r = await client.post("/v1/ask", headers=auth("alpha"), json=ask_in_turn(i, n, tokens=96))
                    results.append((began, time.monotonic(), r.status_code, r.json(),
                                    r.headers.get("x-sluice-replica")))
                    n += 1

            async def kill() -> float:
                # The victim is a replica of this deployment (one that answered here: the last
                # deployment's may still be listed while they drain) with requests in its engine.
                nonlocal before, victim
                await asyncio.sleep(KILL_AT_S)
                while True:
                    listed = (await client.get("/replicas")).json()
                    served = {replica for *_, replica in results}
                    busy = [r["replica"] for r in listed if r["replica"] in served
                            and r["engine"]["small"]["running"] + r["engine"]["small"]["waiting"] > 0]
                    if len(listed) == 2 and busy:
                        before, victim = {r["replica"]: r["pid"] for r in listed}, busy[0]
                        os.kill(before[victim], signal.SIGKILL)
                        return time.monotonic()
                    assert time.monotonic() < start + LOAD_S - 2, ("no replica of this deployment busy", listed)

            killed, *_ = await asyncio.gather(kill(), *(user(i) for i in range(CLIENTS)))
            return killed

    killed = asyncio.run(load())
    failed = [(began, ended, body) for began, ended, status, body, _ in results if status != 200]
    assert failed, ("the kill failed no request", victim, killed,
                    [(round(b - killed, 2), round(e - killed, 2), s, r) for b, e, s, _, r in results if b < killed < e])
    for began, ended, body in failed:        # only requests in flight at the kill, each saying why
        assert began < killed < ended and body["error"]["code"] == "replica_failed", (began, ended, killed, body)
        assert "died" in body["error"]["message"]
    # What was in flight elsewhere finished: the survivor's requests across the kill all answered.
    # The victim may show answers across it too: a reply it sent just before the kill is read after.
    survivor = next(r for r in before if r != victim)
    spanned = [(status, replica) for began, ended, status, _, replica in results if began < killed < ended]
    assert all(status == 200 for status, replica in spanned if replica == survivor), spanned
    assert len(spanned) <= CLIENTS and any(replica == victim for *_, replica in results)
    answered = [body["id"] for _, _, status, body, _ in results if status == 200]
    rows = ledger_ids(config)
    assert len(rows) == len(set(rows)) and set(answered) <= set(rows)   # every answer has its one row
    deadline = time.monotonic() + 120        # Serve starts a replacement
    while time.monotonic() < deadline:
        now = {r["replica"]: r["pid"] for r in httpx.get(f"{cluster}/replicas").json()}
        if len(now) == 2 and victim not in now:
            break
        time.sleep(1)
    assert len(now) == 2 and victim not in now and before[victim] not in now.values(), now
    r = httpx.post(f"{cluster}/v1/ask", headers=auth("alpha"), timeout=60,
                   json={"question": "t1 t2 t3 t4", "collection": "topics", "max_output_tokens": 4})
    assert r.status_code == 200
