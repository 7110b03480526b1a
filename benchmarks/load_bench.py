"""Overload and soak: what the server promises when more comes than it can answer, and over time.

The server is the real `sluice serve` in its own process on 127.0.0.1, serving SmolLM2-135M
(the `smollm2-135m` store model), 16 generations at once and 32 queued, a 20 s deadline per
request. First its capacity: 16 closed-loop clients for 20 s (requests a second, all 200).

- `overload`: requests arrive at random (Poisson) at `--factor` (10) times that capacity for
  `--seconds` (120); then load stops and five requests, one after another, check that it
  answers normally at once. Promised: every refusal is a 503 with Retry-After, no other 5xx,
  the admitted answered within their deadline (p99), memory flat (the slope of the resident
  set, sampled each second), and one ledger row per answered request.
- `soak`: a steady `--share` (0.5) of capacity for `--minutes` (60; `make soak`) of mixed
  traffic: /v1/ask plain, streamed and over a collection, /v1/chat/completions plain and
  streamed, in turn. Promised: memory and p99 latency flat (slopes stated, per minute), no
  error, and every KV block free again at the end.

    .venv/bin/python benchmarks/load_bench.py overload [--factor 10] [--seconds 120]
    .venv/bin/python benchmarks/load_bench.py soak [--minutes 60]
Prints a table; writes benchmarks/results/load_bench-<mode>.json and a .png of memory and
latency over time. The client runs on the same cores as the server.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from common import RESULTS, percentile, resident_mb, sluice_server, smollm_setup, write_results

KEY = "sk-load"
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
             "What does a compiler do?", "Why is the sky blue?", "What is two plus two?"]
OUTPUT_TOKENS, INFLIGHT, QUEUED, DEADLINE_S = 16, 16, 32, 20.0
KINDS = ("ask", "ask-stream", "ask-rag", "chat", "chat-stream")
FACTS = ["Paris is the capital of France and its largest city.", "Red, yellow and blue are primary colours.",
         "A spider has eight legs; insects have six.", "A compiler translates source code into machine code.",
         "The sky looks blue because air scatters short wavelengths of sunlight more than long ones."]


def write_setup(folder: Path) -> list[str]:
    return smollm_setup(folder, {"load": KEY}, OUTPUT_TOKENS, f"max_inflight = {INFLIGHT}\nmax_queued = {QUEUED}\n"
                                                            f"request_timeout_s = {DEADLINE_S}")


async def ask(http: httpx.AsyncClient, samples: list, started: float, kind: str = "ask") -> None:
    """One request of a kind (KINDS); a sample is (seconds since start, status, latency, error
    code, has Retry-After, kind). A stream that ends in an error event counts as that error."""
    start, question = time.monotonic(), random.choice(QUESTIONS)
    url, body = ("/v1/chat/completions", {"model": "small", "max_tokens": OUTPUT_TOKENS,
                                          "messages": [{"role": "user", "content": question}]}) \
        if kind.startswith("chat") else ("/v1/ask", {"question": question, "max_output_tokens": OUTPUT_TOKENS})
    body |= {"stream": True} if kind.endswith("stream") else {"collection": "facts"} if kind == "ask-rag" else {}
    try:
        async with http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            text = (await r.aread()).decode()
        code = None if r.status_code == 200 else r.json().get("error", {}).get("code")
        if r.status_code == 200 and kind.endswith("stream") and "event: error" in text:
            code = "stream_error"
        samples.append((start - started, r.status_code, time.monotonic() - start, code, "retry-after" in r.headers,
                        kind))
    except httpx.HTTPError as e:              # the connection itself failed: counted, never hidden
        samples.append((start - started, 0, time.monotonic() - start, type(e).__name__, False, kind))


async def closed_loop(url: str, clients: int, seconds: float) -> tuple[float, int]:
    """Requests a second, and how many, `clients` each sending the next as soon as it has an answer."""
    samples: list = []
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients)) as http:
        until, started = time.monotonic() + seconds, time.monotonic()

        async def user():
            while time.monotonic() < until:
                await ask(http, samples, started)
        await asyncio.gather(*(user() for _ in range(clients)))
        wall = time.monotonic() - started
    assert all(s[1] == 200 for s in samples), Counter(s[1] for s in samples)
    return len(samples) / wall, len(samples)


async def open_loop(url: str, pid: int, rate: float, seconds: float, kinds=("ask",)) -> tuple[list, list]:
    """Poisson arrivals at `rate` a second for `seconds`, of `kinds` in turn, waiting for the
    last answers; and the server's resident memory each second, as (seconds, MB)."""
    samples, memory, tasks = [], [], []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S * 3, limits=limits) as http:
        started = time.monotonic()

        async def sample_memory():
            while True:
                memory.append((time.monotonic() - started, resident_mb(pid)))
                await asyncio.sleep(1.0)
        sampler = asyncio.create_task(sample_memory())
        next_at = started
        while next_at < started + seconds:
            next_at += random.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(ask(http, samples, started, kinds[len(tasks) % len(kinds)])))
        await asyncio.gather(*tasks)
        sampler.cancel()
    return samples, memory


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per minute; the first tenth (warming up) left out."""
    xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    keep = xs >= xs.max() / 10
    return float(np.polyfit(xs[keep], ys[keep], 1)[0] * 60) if keep.sum() > 2 else 0.0


def ledger_rows(folder: Path) -> dict[str, int]:
    with sqlite3.connect(folder / "data" / "ledger.sqlite") as db:
        return dict(db.execute("SELECT status, count(*) FROM requests GROUP BY status").fetchall())


def kv_free(url: str) -> tuple[float, float]:
    """Free and total KV blocks, from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    gauge = lambda name: sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))
    return gauge("sluice_kv_blocks_free"), gauge("sluice_kv_blocks_total")


def summarize(samples: list, memory: list, seconds: float) -> dict:
    statuses = Counter(s[1] for s in samples)
    admitted = [s[2] for s in samples if s[1] == 200]
    windows = sorted((s[0], s[2]) for s in samples if s[1] == 200)
    per_minute = [(m * 60 + 30, percentile([lat for t, lat in windows if m * 60 <= t < (m + 1) * 60], 0.99))
                  for m in range(int(seconds // 60)) if any(m * 60 <= t < (m + 1) * 60 for t, _ in windows)]
    return {
        "requests": len(samples), "kinds": dict(Counter(s[5] for s in samples)),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "error_codes": dict(Counter(s[3] for s in samples if s[3])),
        "refusals_without_retry_after": sum(1 for s in samples if s[1] == 503 and not s[4]),
        "other_5xx": sum(v for k, v in statuses.items() if k >= 500 and k != 503),
        "connection_errors": statuses.get(0, 0),
        "answered": len(admitted), "answered_per_s": round(len(admitted) / seconds, 2),
        "admitted_latency_s": {"p50": round(percentile(admitted, 0.5), 2), "p99": round(percentile(admitted, 0.99), 2)}
        if admitted else None,
        "memory_mb": {"start": round(memory[0][1]), "end": round(memory[-1][1]),
                      "max": round(max(m for _, m in memory)), "slope_per_minute": round(slope_per_minute(memory), 2)},
        "p99_by_minute_s": [round(p, 2) for _, p in per_minute],
        "p99_slope_s_per_minute": round(slope_per_minute(per_minute), 3) if len(per_minute) > 2 else None,
    }


def plot(samples: list, memory: list, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot([t for t, _ in memory], [m for _, m in memory])
    a.set_ylabel("server resident MB")
    a.set_title(title)
    for status, color in ((200, "tab:blue"), (503, "tab:orange"), (504, "tab:red")):
        pts = [(s[0], s[2]) for s in samples if s[1] == status]
        if pts:
            b.scatter(*zip(*pts), s=3, color=color, label=str(status))
    b.axhline(DEADLINE_S, color="gray", linestyle="--", linewidth=1, label="deadline")
    b.set_xlabel("seconds")
    b.set_ylabel("latency s")
    b.legend(markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["overload", "soak"])
    ap.add_argument("--factor", type=float, default=10.0, help="overload: arrivals, times the capacity")
    ap.add_argument("--seconds", type=float, default=120.0, help="overload: how long")
    ap.add_argument("--minutes", type=float, default=60.0, help="soak: how long")
    ap.add_argument("--share", type=float, default=0.5, help="soak: arrivals, as a share of the capacity")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with sluice_server(write_setup(folder), folder / "server.log") as server:
            _, warm = asyncio.run(closed_loop(server.url, INFLIGHT, 5))                    # warm up
            capacity, measured = asyncio.run(closed_loop(server.url, INFLIGHT, 20))
            factor = args.factor if args.mode == "overload" else args.share
            seconds = args.seconds if args.mode == "overload" else args.minutes * 60
            facts = {"documents": [{"id": f"fact{i}", "text": t} for i, t in enumerate(FACTS)]}
            httpx.post(f"{server.url}/v1/collections/facts/documents", headers={"Authorization": f"Bearer {KEY}"},
                       json=facts, timeout=60).raise_for_status()
            load = os.getloadavg()[0]
            kinds = ("ask",) if args.mode == "overload" else KINDS
            samples, memory = asyncio.run(open_loop(server.url, server.pid, capacity * factor, seconds, kinds))
            time.sleep(1.0)
            after: list = []
            for _ in range(5):
                asyncio.run(_one(server.url, after))
            free, total = kv_free(server.url)
        rows = ledger_rows(folder)
    result = {"benchmark": f"load_{args.mode}", "model": "smollm2-135m", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
              time.gmtime()), "machine": {"cpus": os.cpu_count(), "load_average_1m": round(load, 2)},
              "settings": {"max_inflight": INFLIGHT, "max_queued": QUEUED, "deadline_s": DEADLINE_S,
                           "output_tokens": OUTPUT_TOKENS},
              "capacity_rps": round(capacity, 2), "arrival_rps": round(capacity * factor, 2), "seconds": seconds,
              **summarize(samples, memory, seconds),
              "after_load": {"statuses": [s[1] for s in after], "latency_s": [round(s[2], 2) for s in after]},
              "kv_blocks_free_at_end": [free, total], "ledger_rows": rows}
    answered = warm + measured + sum(1 for s in samples + after if s[1] == 200)
    result["ledger_rows_for_answers"] = rows.get("ok", 0) == answered
    r = result
    print(f"{args.mode}: SmolLM2-135M, capacity {r['capacity_rps']} req/s, arrivals {r['arrival_rps']} req/s for "
          f"{seconds:.0f} s, load average {load:.1f} on {os.cpu_count()} CPUs")
    print("| requests | statuses | refusals without Retry-After | other 5xx | admitted p50 / p99 s | memory MB "
          "start / end / slope per min | p99 slope s/min | after load | ledger rows = answers |")
    print("|---|---|---|---|---|---|---|---|---|")
    lat = r["admitted_latency_s"] or {"p50": "-", "p99": "-"}
    m = r["memory_mb"]
    print(f"| {r['requests']} | {r['statuses']} | {r['refusals_without_retry_after']} | {r['other_5xx']} | "
          f"{lat['p50']} / {lat['p99']} | {m['start']} / {m['end']} / {m['slope_per_minute']} | "
          f"{r['p99_slope_s_per_minute']} | {r['after_load']['statuses']} | {r['ledger_rows_for_answers']} |")
    out = RESULTS / f"load_bench-{args.mode}.json"
    write_results(out, result)
    plot(samples, memory, out.with_suffix(".png"), f"{args.mode}: {r['arrival_rps']} req/s against a capacity of "
                                                   f"{r['capacity_rps']}")
    return 0


async def _one(url: str, samples: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await ask(http, samples, time.monotonic())


if __name__ == "__main__":
    sys.exit(main())
