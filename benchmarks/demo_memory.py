"""`make run`'s memory: `sluice serve --demo` started once per weights precision of its two
models (int8, the default, and gguf, the GGUF files' own blocks), its resident memory read
once it is ready (/readyz answers), and again after one answered question (the banner's); with the engine's
own count of each model's weight bytes (`sluice_engine_weight_bytes`) beside it.

Then each model loaded alone, once per precision, in a fresh process (engine/worker.py's `_load`):
what loading leaves resident beyond the weights it counts, before and after the engine hands the
heap's freed pages back (`_return_freed_memory`, which the engine calls after its models load).

One server at a time (the demo holds some 10 GB once ready): nothing else should run.
Prints a table; writes benchmarks/results/demo_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import RESULTS, ROOT, machine, resident_mb, sluice_server, write_results
from rich.console import Console
from rich.table import Table

from gateway.commands import DEMO_COLLECTION, DEMO_KEY, DEMO_QUESTION

console = Console(width=140)
PRECISIONS = ("int8", "gguf")
MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def config(precision: str, folder: Path) -> Path:
    """The demo's engine (gateway/config.py's default_engine) with both models at `precision`."""
    path = folder / f"{precision}.toml"
    path.write_text(f'[engine]\nspeculative = {{target = "large", draft = "small"}}\n'
                    f'[engine.models.small]\nsource = "qwen2.5-coder-0.5b"\nquant = "{precision}"\n'
                    f'[engine.models.large]\nsource = "qwen2.5-coder-1.5b"\nquant = "{precision}"\n')
    return path


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


def load_alone(precision: str, model: str) -> dict:
    """In this (fresh) process: MB resident beyond the loaded model's weights, before and after
    the freed pages go back."""
    from engine import worker
    from engine.config import EngineConfig, ModelEntry
    from engine.model_runner import Device
    entry = ModelEntry(model, quant=precision)
    device = Device.resolve(EngineConfig(models={"m": entry}))
    before = resident_mb(os.getpid())
    loaded = worker._load(entry, False, device)[1]
    weights = worker.weight_bytes(loaded) / 2**20
    loaded_mb = resident_mb(os.getpid()) - before
    worker._return_freed_memory()
    return {"weights_mb": weights, "beyond_weights_mb": loaded_mb - weights,
            "beyond_weights_mb_returned": resident_mb(os.getpid()) - before - weights}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--out", type=Path, default=RESULTS / "demo_memory.json")
    ap.add_argument("--load-alone", nargs=2, metavar=("PRECISION", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_alone:         # the child process of the loads' table
        print(json.dumps(load_alone(*args.load_alone)))
        return
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
    loads = Table(title="Each model loaded alone in a fresh process: MB resident beyond its weights")
    for col in ("weights", "model", "weights MB", "beyond, loaded", "beyond, freed pages returned"):
        loads.add_column(col, justify="right")
    results["loads"] = {}
    for precision in args.precisions:
        for model in MODELS:
            out = subprocess.run([sys.executable, __file__, "--load-alone", precision, model], check=True,
                                 capture_output=True, text=True).stdout
            r = results["loads"][f"{precision} {model}"] = json.loads(out.strip().splitlines()[-1])
            loads.add_row(precision, model, f"{r['weights_mb']:,.0f}", f"{r['beyond_weights_mb']:,.0f}",
                          f"{r['beyond_weights_mb_returned']:,.0f}")
    console.print(loads)
    write_results(args.out, results)
    console.print(f"wrote {args.out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
