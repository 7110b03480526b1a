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
- affinity: tests/test_ray_serve.py's workload (20 questions, 5 topics in turn, 2 replicas
  whose KV cache holds about 3 topics): share of prompt tokens served from the prefix cache,
  affine router against round robin, from the replicas' engine counters.

    .venv/bin/python benchmarks/scale_bench.py [--parts ledger replicas affinity] [--clients 8] [--seconds 30]
Prints the figures; writes benchmarks/results/scale_bench.json.
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


def row(i: int):
    from gateway.ledger import UsageRow
    return UsageRow(f"req_{i}", time.time(), "2026-01", "bench", "ask", "ok", "small", "small", "docs", 400, 256, 32,
                    0, 0.0012, 3.0, 0.1, 40.0, 120.0, "tenant default", None, None, False, "length")


async def ledger_cost(where, rows: int, writers: int) -> dict:
    """`writers` tasks each recording its share of `rows` rows one after another."""
    from gateway.ledger import Ledger
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
    parser.add_argument("--parts", nargs="+", default=["ledger", "replicas", "affinity"],
                        choices=["ledger", "replicas", "affinity"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    # Others' work on this machine slows every figure: the load average says how busy it was.
    results: dict = {"machine": machine(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    if "ledger" in args.parts:
        results["ledger"] = bench_ledger(root)
        print(json.dumps(results["ledger"], indent=1), flush=True)
    if {"replicas", "affinity"} & set(args.parts):
        import ray
        from ray import serve
        from tests.test_ray_serve import start_ray
        url = start_ray()
        try:
            if "replicas" in args.parts:
                results["replicas"] = bench_replicas(url, root, args.clients, args.seconds, args.tokens)
            if "affinity" in args.parts:
                results["affinity"] = bench_affinity(url, root)
                print(json.dumps(results["affinity"]), flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scale_bench.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
