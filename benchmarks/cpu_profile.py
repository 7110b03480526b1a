"""Where a CPU decode step's time goes: a per-operator profile (torch profiler) of steady
decode steps (`--batch` requests together, 1 by default) for each model and precision, grouped
into the weight-reading matmuls and everything else (attention over the paged cache, norms,
rotary, the SiLU product, sampling, and the Python between ops, which is the step's wall time
less its operators' own time).

Prints a table and writes benchmarks/results/cpu_profile.json; the shares say how much of a step
faster matmuls alone could win back. `--cpu-step off on`: each also with its layers' operators
called from Python (EngineConfig.cpu_step off) and in one compiled call (on, the default).
"""
from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import torch
from common import RESULTS, machine, write_results
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from models.store import resolve

console = Console(width=150)
# Operator names by the part of the step they belong to, first match wins.
PARTS = [("weight matmuls",
          r"_weight_int[48]pack_mm|sluice::(int[48]|gguf)_linear|aten::(_int_mm|mm|addmm|bmm|matmul|linear)$"),
         ("attention", r"scaled_dot_product|_flash_attention|paged_decode_attention|index_select|aten::view_as|"
                       r"aten::where"),
         ("norms", r"rms_norm|rsqrt|pow|mean"),
         ("rotary", r"aten::(cat|chunk|neg)$|rotary_store_kv"),
         ("activation", r"silu"),
         ("sampling", r"log_softmax|argmax|amax|gather|topk|sort|multinomial"),
         ("elementwise, copies, views", r".")]


def profile_steps(engine: LLMEngine, steps: int, batch: int) -> dict:
    """Self CPU time per part over `steps` steady decode steps of `batch` requests, per step."""
    rng = random.Random(0)
    vocab = engine.worker(None).cfg.vocab_size
    for _ in range(batch):
        engine.add_request([rng.randrange(1000, min(vocab, 30000)) for _ in range(32)],
                           SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    for _ in range(6):                          # the prompts, then a few steps to warm up
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = 1e3 * (time.perf_counter() - start) / steps
    while engine.has_work():
        engine.step()
    parts: dict[str, float] = {}
    ops: dict[str, float] = {}
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / steps
        part = next(p for p, pattern in PARTS if re.search(pattern, e.key))
        parts[part] = parts.get(part, 0.0) + ms
        ops[e.key] = ms
    parts["python between ops"] = max(wall_ms - sum(parts.values()), 0.0)
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])
    return {"wall_ms": wall_ms, "parts_ms": parts, "top_ops_ms": top,
            "not_matmul_share": 1 - parts.get("weight matmuls", 0.0) / wall_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--quants", nargs="+", default=["int8", "int4"], choices=["none", "int8", "int4", "gguf"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--cpu-step", nargs="+", default=["on"], choices=["on", "off"])
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_profile.json")
    args = ap.parse_args()
    results = {"machine": machine(), "steps": args.steps, "batch": args.batch, "models": {}}
    names = [p for p, _ in PARTS] + ["python between ops"]
    table = Table(title=f"A batch-{args.batch} CPU decode step, ms per part ({machine()['isa']}, "
                        f"{torch.get_num_threads()} threads)")
    for col in ("model", "weights", "one call", "step ms", *names, "not matmuls"):
        table.add_column(col)
    for name in args.models:
        folder = resolve(name, progress=False)
        results["models"][name] = {}
        for quant, step in [(q, s) for q in args.quants for s in args.cpu_step]:
            engine = LLMEngine(EngineConfig(models={"m": ModelEntry(str(folder), quant=quant)}, device="cpu",
                                            memory_budget_gb=6.0, cpu_step=step == "on"), progress=False)
            key = quant if args.cpu_step == ["on"] else f"{quant}, cpu_step {step}"
            r = results["models"][name][key] = profile_steps(engine, args.steps, args.batch)
            del engine
            table.add_row(name, quant, step, f"{r['wall_ms']:.1f}",
                          *[f"{r['parts_ms'].get(p, 0.0):.2f}" for p in names], f"{r['not_matmul_share']:.0%}")
    console.print(table)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
