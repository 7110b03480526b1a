"""Weight-only quantization and int8 KV, measured side by side in one run.

For each model and precision (none, int8, int4): weight bytes, decode tokens/s at batch 1
and batch 16, and the fraction of the memory-bandwidth roofline reached at batch 1
(tokens/s x weight bytes read per token / measured read bandwidth). Then how many
1,500-token sequences fit a fixed KV budget with float32 and with int8 KV.
Prints a table and writes benchmarks/results/quant_bench.json.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from common import RESULTS, machine, memory_bandwidth_gbs
from rich.console import Console
from rich.table import Table

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker import weight_bytes

console = Console()


def decode_tok_s(engine: LLMEngine, batch: int, n: int) -> float:
    """Steady decode rate: tokens after the first of each request, over the time they took."""
    prompt = engine.worker("m").tokenizer.encode("Write a long story about a lighthouse keeper and the sea.")
    engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))     # warm up
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate([prompt + [i] for i in range(batch)], params)
    end = time.perf_counter()
    first = max(c.ttft for c in done)           # all prefills are over by then
    return batch * (n - 1) / (end - start - first)


def kv_capacity(model: str, kv_dtype: str, budget_gb: float, seq_len: int) -> int:
    from engine.config import ModelConfig
    from engine.model_runner import ModelRunner
    from models.store import resolve
    cfg = ModelConfig.from_folder(resolve(model))
    per_block = ModelRunner.kv_bytes_per_block(cfg, 16, kv_dtype == "int8")
    return int(budget_gb * 2**30 // per_block) // math.ceil(seq_len / 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--quants", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kv-budget-gb", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "quant_bench.json")
    args = ap.parse_args()
    bw = memory_bandwidth_gbs()
    rows = []
    for model in args.models:
        for quant in args.quants:
            console.print(f"{model} {quant}")
            engine = LLMEngine(EngineConfig(models={"m": ModelEntry(model, quant=quant)}, max_kv_blocks=1024),
                               progress=False)
            nbytes = weight_bytes(engine.worker("m").model)
            read = weight_bytes(engine.worker("m").model, per_token=True)
            b1, b16 = decode_tok_s(engine, 1, args.tokens), decode_tok_s(engine, 16, args.tokens)
            rows.append({"model": model, "quant": quant, "weight_bytes": nbytes, "tok_s_b1": b1, "tok_s_b16": b16,
                         "bytes_read_per_token": read, "roofline_fraction_b1": b1 * read / (bw * 1e9)})
            del engine
    kv = [{"model": m, "kv_budget_gb": args.kv_budget_gb, "seq_len": 1500,
           "float32_seqs": kv_capacity(m, "float32", args.kv_budget_gb, 1500),
           "int8_seqs": kv_capacity(m, "int8", args.kv_budget_gb, 1500)} for m in args.models]
    table = Table(title=f"Weight-only quantization, decode (read bandwidth {bw:.1f} GB/s)")
    for col in ("model", "quant", "weights GB", "b1 tok/s", "vs none", "b16 tok/s", "vs none", "roofline b1"):
        table.add_column(col)
    for r in rows:
        base = next((x for x in rows if x["model"] == r["model"] and x["quant"] == "none"), r)
        table.add_row(r["model"], r["quant"], f"{r['weight_bytes'] / 1e9:.2f}", f"{r['tok_s_b1']:.2f}",
                      f"{r['tok_s_b1'] / base['tok_s_b1']:.2f}x", f"{r['tok_s_b16']:.1f}",
                      f"{r['tok_s_b16'] / base['tok_s_b16']:.2f}x", f"{r['roofline_fraction_b1']:.0%}")
    console.print(table)
    kv_table = Table(title=f"1,500-token sequences that fit {args.kv_budget_gb} GiB of KV")
    for col in ("model", "float32 KV", "int8 KV", "ratio"):
        kv_table.add_column(col)
    for k in kv:
        kv_table.add_row(k["model"], str(k["float32_seqs"]), str(k["int8_seqs"]),
                         f"{k['int8_seqs'] / k['float32_seqs']:.2f}x")
    console.print(kv_table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine() | {"read_bandwidth_gbs": bw}, "decode": rows, "kv": kv},
                                   indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
