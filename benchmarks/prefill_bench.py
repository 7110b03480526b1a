"""Prefill on the CPU with quantized weights: the quantized kernels at every row (`dequant_rows`
0: integer dot products where they run, as on AVX2 hosts with the compiled kernels, else torch's
packed op) against float32 matmuls over weights dequantized slice by slice from DEQUANT_ROWS
rows, in one run, at int8 and int4.

For each model and prompt length (SQuAD passages run together, as a RAG prompt is): time to
first token, the median of `--repeats` turns taken alternately (on, off, on, off ...) so a
change in the machine's speed hits both alike, and whether the two greedy answers agree (the
float32 path rounds differently from bf16 activations, so a near-tie may flip; the answer's
first token and its probability are shown). Prints a table and writes
benchmarks/results/prefill_bench.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

from common import RESULTS, ROOT, machine
from rich.console import Console
from rich.progress import track
from rich.table import Table

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.quantize import DEQUANT_ROWS, dequant_rows_default, dot_rows_default
from engine.sampling_params import SamplingParams

console = Console(width=140)
ROWS = DEQUANT_ROWS["cpu"]
MODELS = {"small": "qwen2.5-coder-0.5b", "large": "qwen2.5-coder-1.5b"}


def passages(data: Path) -> str:
    articles = json.loads((data / "squad-v1.1-dev-part-a.json").read_text())["data"]
    return "\n\n".join(p["context"] for a in articles[:3] for p in a["paragraphs"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048], help="prompt tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--quants", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("SLUICE_DATA", ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill_bench.json")
    args = ap.parse_args()
    text = passages(args.data)
    params = SamplingParams(max_tokens=8)
    rows = []
    for name, quant in [(m, q) for m in args.models for q in args.quants]:
        # Prefix caching off: every turn computes its whole prompt.
        engines = {rows_: LLMEngine(EngineConfig(models={"m": ModelEntry(MODELS[name], quant=quant,
                                                                         dequant_rows=rows_)},
                                                 max_kv_blocks=512, prefix_caching=False), progress=False)
                   for rows_ in (ROWS, 0)}
        tok = engines[0].worker("m").tokenizer
        ids = tok.encode(text)
        for length in args.lengths:
            tail = tok.encode("\n\nQuestion: what is this about?\nAnswer:")
            prompt = ids[:length - len(tail)] + tail
            times: dict[int, list[float]] = {r: [] for r in engines}
            outs = {}
            for _ in track(range(args.repeats), description=f"{name} {quant} {length} tokens", console=console):
                for r, e in engines.items():
                    done = e.generate([prompt], params)[0]
                    times[r].append(done.ttft)
                    outs[r] = done
            on, off = (statistics.median(times[r]) for r in engines)
            a, b = (outs[r] for r in engines)
            rows.append({"model": MODELS[name], "quant": quant, "prompt_tokens": len(prompt),
                         "default_dequant_rows": dequant_rows_default("cpu", quant, ModelEntry(MODELS[name]).group_size,
                                                                     dot_rows_default()),
                         "ttft_dequant_s": on, "ttft_quantized_s": off, "speedup": off / on,
                         "prefill_tok_s_dequant": len(prompt) / on, "prefill_tok_s_quantized": len(prompt) / off,
                         "same_answer": a.token_ids == b.token_ids,
                         "first_token_p": [round(math.exp(a.logprobs[0]), 4), round(math.exp(b.logprobs[0]), 4)]})
        del engines
    table = Table(title=f"Prefill, {machine()['isa']}, {machine()['threads']} threads: time to first token, "
                        f"dequantized float32 matmuls (from {ROWS} rows) against the quantized kernels at every "
                        f"row, median of {args.repeats}")
    for col in ("model", "weights", "prompt tokens", "quantized s", "dequantized s", "dequantized vs quantized",
                "prefill tok/s", "default", "same answer"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["quant"], str(r["prompt_tokens"]), f"{r['ttft_quantized_s']:.2f}",
                      f"{r['ttft_dequant_s']:.2f}", f"{r['speedup']:.2f}x",
                      f"{r['prefill_tok_s_quantized']:.0f} / {r['prefill_tok_s_dequant']:.0f}",
                      "dequantized" if r["default_dequant_rows"] else "quantized",
                      "yes" if r["same_answer"] else f"no (first token p {r['first_token_p'][1]} / "
                                                     f"{r['first_token_p'][0]})")
    console.print(table)
    out = args.out
    out.write_text(json.dumps({"machine": machine(), "dequant_rows": ROWS,
                               "repeats": args.repeats,
                               "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
