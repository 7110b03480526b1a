"""Sluice past one process, on this machine: replicas on Ray Serve, the shared ledger, and
the cache-affine router. Three parts:

- ledger: what committing a usage row costs in SQLite (the embedded default, WAL with
  synchronous NORMAL and FULL) and in PostgreSQL (fsync on, synchronous_commit on; a
  throwaway server on loopback): one writer awaiting each row, and 32 writers at once (the
  group commit's throughput).
- replicas: requests/s and latency p50/p99 for 1 and 2 replicas of a tiny random model on a
  local Ray (PostgreSQL ledger, Redis limits), `clients` clients for `seconds` seconds, each
  asking /v1/ask from a 5-topic collection for `tokens` output tokens. `in_replica_ms` is
  the replica's own account (timings.total); the rest of the latency is the ingress (the
  prefix key: embedding and search) and Serve's proxy and handle hops. On a 2-core machine
  the replicas, the ingress, Serve's proxy and the client share the two cores.
- ingress: what computing a request's prefix key costs the ingress (tenant, embedding,
  search, trimming, hashing), one request at a time, in this process.
- affinity: tests/test_ray_serve.py's workload (20 questions, 5 topics in turn, 2 replicas
  whose KV cache holds about 3 topics): share of prompt tokens served from the prefix cache,
  affine router against round robin, from the replicas' engine counters.

    .venv/bin/python benchmarks/scale_bench.py [--parts ledger replicas ingress affinity] [--clients 8] [--seconds 30]
Prints the figures; writes them into benchmarks/results/scale_bench.json (the parts run
replace theirs, the others stay), with the 1-minute load average before and after each part.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from common import RESULTS, machine, percentile

PARTS = ["ledger", "replicas", "ingress", "affinity"]


def row(i: int):
    from gateway.usage.rows import UsageRow
    return UsageRow(f"req_{i}", time.time(), "2026-01", "bench", "ask", "ok", "small", "small", "docs", 400, 256, 32,
                    0, 0.0012, 3.0, 0.1, 40.0, 120.0, "tenant default", None, None, False, "length")


async def ledger_cost(where, rows: int, writers: int) -> dict:
    """`writers` tasks each recording its share of `rows` rows one after another."""
    from gateway.usage.ledger import Ledger
    ledger = Ledger(*where)
    await ledger.record(replace(row(-1), request_id="warm-up"))
    latencies: list[float] = []

    async def writer(w: int) -> None:
        for i in range(w, rows, writers):
            start = time.perf_counter()
            await ledger.record(row(i))
            latencies.append((time.perf_counter() - start) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    wall = time.perf_counter() - start
    ledger.close()
    assert len(ledger.rows()) == rows + 1
    return {"writers": writers, "rows": rows, "rows_per_s": round(rows / wall, 1),
            "ms_per_row": {"mean": round(sum(latencies) / rows, 3), "p50": round(percentile(latencies, 0.5), 3),
                           "p99": round(percentile(latencies, 0.99), 3)}}


def bench_ledger(root: Path) -> dict:
    from tests.services import Postgres
    postgres = Postgres(fsync=True)
    try:
        stores = {"sqlite_normal": lambda: (root / f"normal-{time.time_ns()}.sqlite", "NORMAL"),
                  "sqlite_full": lambda: (root / f"full-{time.time_ns()}.sqlite", "FULL"),
                  "postgresql": lambda: (postgres.fresh_database(),)}
        out = {name: [asyncio.run(ledger_cost(where(), rows, writers)) for rows, writers in ((500, 1), (3000, 32))]
               for name, where in stores.items()}
    finally:
        postgres.stop()
    return out


async def load(url: str, clients: int, seconds: float, tokens: int) -> dict:
    import httpx

    from tests.test_gateway_support import auth
    from tests.test_ray_serve import TOPICS, topic_words
    latencies: list[float] = []
    inside: list[float] = []              # the replica's own account: arrival to answer (timings.total)
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients)) as client:
        start = time.monotonic()

        async def user(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < start + seconds:
                words = topic_words(rng.randrange(TOPICS))
                began = time.perf_counter()
                r = await client.post("/v1/ask", headers=auth("alpha"), json={
                    "question": " ".join(rng.sample(words, 4)), "collection": "topics", "max_output_tokens": tokens})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    latencies.append((time.perf_counter() - began) * 1000)
                    inside.append(r.json()["timings"]["total"])

        await asyncio.gather(*(user(i) for i in range(clients)))
        wall = time.monotonic() - start
    return {"clients": clients, "seconds": round(wall, 1), "answered": len(latencies), "statuses": statuses,
            "requests_per_s": round(len(latencies) / wall, 2),
            "latency_ms": {"p50": round(percentile(latencies, 0.5), 1), "p99": round(percentile(latencies, 0.99), 1)},
            "in_replica_ms": {"p50": round(percentile(inside, 0.5), 1), "p99": round(percentile(inside, 0.99), 1)}}


def bench_replicas(url: str, root: Path, clients: int, seconds: float, tokens: int) -> list[dict]:
    from tests.test_ray_serve import deploy, make_site
    site = make_site(root / "replicas", kv_blocks=1024)
    out = []
    for n in (1, 2):
        deploy(site, min=n, max=n)
        asyncio.run(load(url, 2, 5, tokens))                # warm up: code paths, each replica once
        out.append({"replicas": n, **asyncio.run(load(url, clients, seconds, tokens))})
        print(f"  {n} replica(s): {out[-1]}", flush=True)
    return out


def bench_ingress(root: Path) -> dict:
    import torch

    from gateway.config import Price, ServerConfig
    from gateway.scale.serve_requests import PrefixKeys
    from tests.test_gateway_support import auth
    from tests.test_ray_serve import TOPICS, make_site, topic_words
    torch.set_num_threads(1)                              # as the ingress runs (serve_ray.SluiceIngress)
    engine, tenants, data = make_site(root / "ingress", kv_blocks=16)
    keys = PrefixKeys(ServerConfig(engine=engine, prices={"small": Price(1.0, 1.0, 1.0)}), tenants, data)
    headers = [(b"authorization", auth("alpha")["Authorization"].encode())]
    rng, times = random.Random(0), []
    for i in range(110):
        body = json.dumps({"question": " ".join(rng.sample(topic_words(i % TOPICS), 4)), "collection": "topics"})
        start = time.perf_counter()
        assert keys.key("/v1/ask", headers, body.encode()) is not None
        times.append((time.perf_counter() - start) * 1000)
    times = times[10:]                                    # the first calls load the tokenizer, warm up
    return {"keys": len(times), "ms_per_key": {"p50": round(percentile(times, 0.5), 2),
                                               "p99": round(percentile(times, 0.99), 2)}}


def bench_affinity(url: str, root: Path) -> dict:
    from tests.test_ray_serve import deploy, hit_rate, make_site
    site = make_site(root / "affinity", kv_blocks=16)
    rates = {}
    for routing in ("round_robin", "affinity"):
        deploy(site, routing=routing)
        rates[routing] = round(hit_rate(url), 4)
    return {"cached_prompt_share": rates, "ratio": round(rates["affinity"] / rates["round_robin"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    out = RESULTS / "scale_bench.json"
    results: dict = json.loads(out.read_text()) if out.exists() else {}
    results["machine"] = machine()
    # Others' work on this machine slows every figure: the load average says how busy it was.
    loads = results.setdefault("load_average_1m", {})
    url = None
    try:
        for part in PARTS:
            if part not in args.parts:
                continue
            if part in ("replicas", "affinity") and url is None:
                from tests.test_ray_serve import start_ray
                url = start_ray()
            before = os.getloadavg()[0]
            results[part] = {"ledger": lambda: bench_ledger(root),
                             "replicas": lambda: bench_replicas(url, root, args.clients, args.seconds, args.tokens),
                             "ingress": lambda: bench_ingress(root),
                             "affinity": lambda: bench_affinity(url, root)}[part]()
            loads[part] = [round(before, 2), round(os.getloadavg()[0], 2)]
            print(part, json.dumps(results[part]), flush=True)
    finally:
        if url is not None:
            import ray
            from ray import serve
            serve.shutdown()
            ray.shutdown()
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
