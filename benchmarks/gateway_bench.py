"""Gateway overhead: what HTTP, auth, limits, routing and the ledger add to a request.

The server is the real `sluice serve` in its own process, on 127.0.0.1, serving two tiny
random-weight models (the engine's cost is then a few milliseconds); each request is a
/v1/ask without a collection for ONE output token. Overhead is measured as

    client-observed latency  -  the engine time the response reports (timings.engine)
                             -  the retrieval time it reports (timings.retrieval: prompt building)

with a minimal keep-alive client whose own cost is microseconds, so it is the server's
HTTP stack, event loop and pipeline, plus loopback.
"server-side" is the same on the server's clock (timings.total minus the same two), so it
excludes HTTP parsing and sending. Each client sends its next request as soon as it has
an answer: at 20 clients the server is saturated, and a request's overhead includes its
wait behind the other 19 on the one event loop. Target: overhead p50 <= 10 ms, p99 <= 30 ms.

    .venv/bin/python benchmarks/gateway_bench.py [--requests 300] [--clients 1 20]
Prints a table; writes benchmarks/results/gateway_bench.json.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, sluice_server

KEY = "sk-bench"
TARGET_P50_MS, TARGET_P99_MS = 10.0, 30.0


def write_setup(folder: Path, synchronous: str) -> list[str]:
    """Tiny models, one tenant with limits that never bind, a server config; returns CLI args."""
    import torch

    from tests.conftest import make_tiny_model
    torch.set_num_threads(1)
    small = make_tiny_model(folder / "small", "qwen2", seed=1)
    large = make_tiny_model(folder / "large", "qwen2", seed=2)
    (folder / "tenants").mkdir()
    (folder / "tenants" / "bench.toml").write_text(f"""
api_key_sha256 = ["{hashlib.sha256(KEY.encode()).hexdigest()}"]
allowed_models = ["small", "large"]
default_model = "small"
context_budget = 400
output_budget = 8
prefix_cache_salt = "bench-salt"
[limits]
requests_per_minute = 100000000
tokens_per_minute = 100000000
monthly_spend_cap_usd = 1000000.0
""")
    (folder / "server.toml").write_text(f"""
ledger_synchronous = "{synchronous}"
[engine]
block_size = 16
max_kv_blocks = 1024
memory_budget_gb = 1.0
num_threads = 1
[engine.models.small]
source = "{small}"
[engine.models.large]
source = "{large}"
""")
    return ["--config", str(folder / "server.toml"), "serve", "--tenants", str(folder / "tenants"),
            "--data", str(folder / "data")]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


class Connection:
    """One keep-alive HTTP/1.1 connection that sends a prepared request and reads the
    response by its Content-Length: microseconds of client work, so what is measured is
    the server (an HTTP library's client would add about a millisecond a request)."""

    def __init__(self, host: str, port: int, path: str, body: dict):
        payload = json.dumps(body).encode()
        self.host, self.port = host, port
        self.request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def send(self) -> tuple[int, bytes]:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (line.partition(": ") for line in lines) if k.lower() == "content-length")
        return int(lines[0].split()[1]), await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def run_load(host: str, port: int, clients: int, requests: int) -> dict:
    body = {"question": "How much does the gateway add to each request?", "max_output_tokens": 1}
    connections = [Connection(host, port, "/v1/ask", body) for _ in range(clients)]
    for c in connections:
        await c.open()
    for _ in range(20):              # warm up: code paths, the prefix cache
        assert (await connections[0].send())[0] == 200
    samples: list[tuple[float, dict]] = []
    left = [requests]

    async def user(connection: Connection) -> None:
        while left[0] > 0:
            left[0] -= 1
            start = time.perf_counter()
            status, payload = await connection.send()
            elapsed = (time.perf_counter() - start) * 1000
            if status != 200:
                raise SystemExit(f"status {status}: {payload[:500]!r}")
            samples.append((elapsed, json.loads(payload)["timings"]))

    start = time.perf_counter()
    await asyncio.gather(*(user(c) for c in connections))
    wall = time.perf_counter() - start
    for c in connections:
        c.close()
    latency = [e for e, _ in samples]
    overhead = [e - t["engine"] - t["retrieval"] for e, t in samples]
    server = [t["total"] - t["engine"] - t["retrieval"] for _, t in samples]
    engine = [t["engine"] for _, t in samples]
    p = lambda xs, q: round(percentile(xs, q), 2)
    return {"clients": clients, "requests": len(samples), "throughput_rps": round(len(samples) / wall, 1),
            "latency_ms": {"p50": p(latency, 50), "p99": p(latency, 99)},
            "engine_ms": {"p50": p(engine, 50), "p99": p(engine, 99)},
            "overhead_ms": {"p50": p(overhead, 50), "p99": p(overhead, 99)},
            "server_side_overhead_ms": {"p50": p(server, 50), "p99": p(server, 99)},
            "meets_target": percentile(overhead, 50) <= TARGET_P50_MS and percentile(overhead, 99) <= TARGET_P99_MS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--requests", type=int, default=300, help="measured requests per concurrency level")
    parser.add_argument("--ledger-synchronous", choices=["NORMAL", "FULL"], default="NORMAL")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gateway_bench.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        setup = write_setup(Path(tmp), args.ledger_synchronous)
        with sluice_server(setup, Path(tmp) / "server.log", {"OMP_NUM_THREADS": "1"}, timeout=120) as server:
            host, port = server.url.removeprefix("http://").split(":")
            load = os.getloadavg()[0]
            results = [asyncio.run(run_load(host, int(port), c, args.requests)) for c in args.clients]
    # uvicorn takes httptools and uvloop when they are installed, else h11 and asyncio's loop.
    stack = {"http": "httptools" if importlib.util.find_spec("httptools") else "h11",
             "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"}

    print(f"gateway overhead on /v1/ask, tiny models, 1 output token, ledger synchronous={args.ledger_synchronous}, "
          f"uvicorn with {stack['http']} and {stack['loop']}, load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'clients':>7} {'requests':>8} {'req/s':>7} {'latency p50/p99 ms':>19} {'engine p50':>10} "
          f"{'overhead p50/p99 ms':>20} {'server-side p50/p99':>20}  target (p50<=10, p99<=30)")
    for r in results:
        lat, ov, sv = r["latency_ms"], r["overhead_ms"], r["server_side_overhead_ms"]
        print(f"{r['clients']:>7} {r['requests']:>8} {r['throughput_rps']:>7} {lat['p50']:>9.2f} /{lat['p99']:>7.2f} "
              f"{r['engine_ms']['p50']:>10.2f} {ov['p50']:>10.2f} /{ov['p99']:>7.2f} "
              f"{sv['p50']:>10.2f} /{sv['p99']:>7.2f}"
              f"  {'met' if r['meets_target'] else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "gateway_overhead", "method": "client latency minus reported engine and retrieval time; "
        "tiny random models; /v1/ask, no collection, 1 output token; server is `sluice serve` in its own process",
        "ledger_synchronous": args.ledger_synchronous, "server_stack": stack,
        "target_ms": {"p50": TARGET_P50_MS, "p99": TARGET_P99_MS},
        "machine": {"cpus": os.cpu_count(), "load_average_1m": round(load, 2), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
