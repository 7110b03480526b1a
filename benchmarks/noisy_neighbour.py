"""Noisy neighbour: one tenant's hostile-but-valid sampling values must not fail or slow
another tenant's requests in the same batches.

The server is the real `sluice serve` in its own process, on 127.0.0.1, serving
SmolLM2-135M-Instruct (the `smollm2-135m` store model) as its one model. Tenant `steady` runs
20 clients, each sending its next /v1/ask (greedy, 16 output tokens) as soon as it has an
answer, for 60 s; then the same again with one client of tenant `hostile` beside them,
cycling through sampling values the API accepts and a naive sampler chokes on (top_p 1e-300
or 5e-324, temperature 1e-138, temperature 2 with the smallest top_p, extreme seeds).
Target: `steady` has no error in either run, and its p99 latency with the hostile client is
within 1.2x of its p99 without.

    .venv/bin/python benchmarks/noisy_neighbour.py [--seconds 60] [--clients 20]
Prints a table; writes benchmarks/results/noisy_neighbour.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from common import RESULTS, percentile, sluice_server, smollm_setup

KEYS = {"steady": "sk-steady", "hostile": "sk-hostile"}
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
             "What does a compiler do?", "Why is the sky blue?", "What is two plus two?"]
HOSTILE = [{"temperature": 0.7, "top_p": 1e-300}, {"temperature": 1e-138, "top_p": 0.9}, {"top_p": 5e-324},
           {"temperature": 2.0, "top_p": 5e-324}, {"temperature": 5e-324, "seed": -(2**63)},
           {"temperature": 2.0, "top_p": 1.0, "seed": 2**63 - 1}]
OUTPUT_TOKENS = 16
TARGET_RATIO = 1.2


def write_setup(folder: Path) -> list[str]:
    """Two tenants whose limits never bind, a server config with SmolLM2; returns CLI args."""
    return smollm_setup(folder, KEYS, OUTPUT_TOKENS, "max_inflight = 64")


async def client(http: httpx.AsyncClient, tenant: str, i: int, until: float, samples: list) -> None:
    """Asks until `until`; each sample is (tenant, status, seconds, error code)."""
    n = 0
    while time.monotonic() < until:
        body = {"question": QUESTIONS[(i + n) % len(QUESTIONS)], "max_output_tokens": OUTPUT_TOKENS}
        if tenant == "hostile":
            body |= HOSTILE[n % len(HOSTILE)]
        start = time.monotonic()
        r = await http.post("/v1/ask", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
        code = None if r.status_code == 200 else r.json().get("error", {}).get("code")
        samples.append((tenant, r.status_code, time.monotonic() - start, code))
        n += 1


async def run(url: str, clients: int, seconds: float, hostile: bool) -> dict:
    samples: list = []
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        until = time.monotonic() + seconds
        users = [client(http, "steady", i, until, samples) for i in range(clients)]
        users += [client(http, "hostile", 0, until, samples)] if hostile else []
        await asyncio.gather(*users)
    out = {}
    for tenant in ("steady", "hostile") if hostile else ("steady",):
        mine = [s for s in samples if s[0] == tenant]
        latency = [s[2] for s in mine if s[1] == 200]
        out[tenant] = {"requests": len(mine), "errors": sum(s[1] != 200 for s in mine),
                       "statuses": dict(Counter(str(s[1]) for s in mine)),
                       "error_codes": dict(Counter(s[3] for s in mine if s[3])),
                       "p50_s": round(percentile(latency, 0.5), 3) if latency else None,
                       "p99_s": round(percentile(latency, 0.99), 3) if latency else None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS / "noisy_neighbour.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with sluice_server(write_setup(Path(tmp)), Path(tmp) / "server.log") as server:
            url = server.url
            asyncio.run(run(url, args.clients, 10, hostile=False))            # warm up
            load = os.getloadavg()[0]
            alone = asyncio.run(run(url, args.clients, args.seconds, hostile=False))
            beside = asyncio.run(run(url, args.clients, args.seconds, hostile=True))
    ratio = beside["steady"]["p99_s"] / alone["steady"]["p99_s"]
    met = alone["steady"]["errors"] == 0 and beside["steady"]["errors"] == 0 and ratio <= TARGET_RATIO
    print(f"noisy neighbour: SmolLM2-135M, {args.clients} clients of tenant steady (greedy, {OUTPUT_TOKENS} tokens), "
          f"{args.seconds:.0f} s a run, load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'run':<26} {'tenant':<8} {'requests':>8} {'errors':>6} {'p50 s':>7} {'p99 s':>7}  statuses")
    for name, result in (("alone", alone), ("with the hostile client", beside)):
        for tenant, r in result.items():
            print(f"{name:<26} {tenant:<8} {r['requests']:>8} {r['errors']:>6} {r['p50_s']:>7} {r['p99_s']:>7}  "
                  f"{r['statuses']} {r['error_codes'] or ''}")
    print(f"steady p99 with / without the hostile client: {ratio:.2f}x (target <= {TARGET_RATIO}x); steady errors "
          f"{alone['steady']['errors'] + beside['steady']['errors']}: {'met' if met else 'MISSED'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "noisy_neighbour", "model": "smollm2-135m (SmolLM2-135M-Instruct)", "clients": args.clients,
        "seconds": args.seconds, "output_tokens": OUTPUT_TOKENS, "hostile_values": HOSTILE,
        "machine": {"cpus": os.cpu_count(), "load_average_1m": round(load, 2)},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "alone": alone, "with_hostile": beside, "p99_ratio": round(ratio, 3), "target_ratio": TARGET_RATIO,
        "met": met}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
