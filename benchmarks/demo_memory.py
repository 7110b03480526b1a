"""`make run`'s memory: `sluice serve --demo` started once per weights precision of its two
models (int8, the default, and gguf, the GGUF files' own blocks), its resident memory read
once it is ready (/readyz answers), and again after one answered question (the banner's); with the engine's
own count of each model's weight bytes (`sluice_engine_weight_bytes`) beside it.

One server at a time (the demo holds some 10 GB once ready): nothing else should run.
Prints a table; writes benchmarks/results/demo_memory.json.
"""
from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import httpx
from common import RESULTS, ROOT, machine, sluice_server, write_results
from rich.console import Console
from rich.table import Table

from gateway.commands import DEMO_COLLECTION, DEMO_KEY, DEMO_QUESTION

console = Console(width=140)
PRECISIONS = ("int8", "gguf")


def config(precision: str, folder: Path) -> Path:
    """The demo's engine (gateway/config.py's default_engine) with both models at `precision`."""
    path = folder / f"{precision}.toml"
    path.write_text(f'[engine]\nspeculative = {{target = "large", draft = "small"}}\n'
                    f'[engine.models.small]\nsource = "qwen2.5-coder-0.5b"\nquant = "{precision}"\n'
                    f'[engine.models.large]\nsource = "qwen2.5-coder-1.5b"\nquant = "{precision}"\n')
    return path


def resident_mb(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def weight_bytes(url: str) -> dict[str, int]:
    """Per model, the engine's weight bytes as loaded (its metrics)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {DEMO_KEY}"}).text
    return {m: int(float(v)) for m, v in re.findall(r'sluice_engine_weight_bytes\{model="(\w+)"[^}]*\} (\S+)', text)}


def measure(precision: str, folder: Path) -> dict:
    log = folder / f"{precision}.log"
    start = time.monotonic()
    with sluice_server(["--config", str(config(precision, folder)), "serve", "--demo"], log, timeout=1200) as server:
        ready_s = time.monotonic() - start
        ready = resident_mb(server.pid)
        r = httpx.post(f"{server.url}/v1/ask", json={"question": DEMO_QUESTION, "collection": DEMO_COLLECTION,
                                                     "max_output_tokens": 128},
                       headers={"Authorization": f"Bearer {DEMO_KEY}"}, timeout=600)
        r.raise_for_status()
        return {"ready_s": ready_s, "resident_mb_ready": ready, "resident_mb_after_answer": resident_mb(server.pid),
                "weight_bytes": weight_bytes(server.url),
                # the engine's memory plan as it logged it at start: weights and KV blocks per model
                "memory_plan": [line for line in log.read_text().splitlines() if "KV blocks of" in line]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--out", type=Path, default=RESULTS / "demo_memory.json")
    args = ap.parse_args()
    results = {"machine": machine(), "question": DEMO_QUESTION, "precisions": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            console.print(f"sluice serve --demo, both models {precision} ...")
            results["precisions"][precision] = measure(precision, Path(tmp))
    table = Table(title="`sluice serve --demo` (make run): resident memory, MB")
    for col in ("weights", "ready after", "resident, ready", "after one answer", "weights: small / large (MB)"):
        table.add_column(col, justify="right")
    for precision, r in results["precisions"].items():
        w = r["weight_bytes"]
        table.add_row(precision, f"{r['ready_s']:.0f} s", f"{r['resident_mb_ready']:,.0f}",
                      f"{r['resident_mb_after_answer']:,.0f}",
                      f"{w.get('small', 0) / 2**20:,.0f} / {w.get('large', 0) / 2**20:,.0f}")
    console.print(table)
    write_results(args.out, results)
    console.print(f"wrote {args.out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
