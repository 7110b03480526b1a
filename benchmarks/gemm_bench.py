"""The matmul under every quantized Linear on this CPU: torch's packed int8 op with bf16
activations against the float32 GEMM on the transposed weight (the engine's float path),
on one of Qwen2.5-Coder-1.5B's layer shapes, from decode's 1 row to prefill's 512.

    python benchmarks/gemm_bench.py

Prints a table and writes benchmarks/results/gemm_bench.json. The "vs 1 row" columns say
how much a batch of rows costs against one: what batched decode and speculative verification
(k + 1 rows per sequence) pay.
"""
from __future__ import annotations

import json

import torch
from common import RESULTS, machine, timed
from rich.console import Console
from rich.table import Table

from engine.quantize import quantize_int8

console = Console()
K, N = 1536, 8960            # the 1.5B's MLP up projection (one half of gate_up)
ROWS = (1, 2, 4, 8, 16, 128, 512)


def best_ms(fn, repeats: int) -> float:
    fn()
    return 1e3 * min(timed(fn) for _ in range(repeats))


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(N, K)
    q, scales = quantize_int8(w)
    scales, w_t = scales.to(torch.bfloat16), w.t().contiguous()
    rows = []
    for m in ROWS:
        x = torch.randn(m, K)
        repeats = 5 if m > 100 else 30
        fp32 = best_ms(lambda: x @ w_t, repeats)
        int8 = best_ms(lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).float(), repeats)
        rows.append({"rows": m, "fp32_ms": fp32, "int8_ms": int8, "fp32_gflops": 2 * m * K * N / fp32 / 1e6,
                     "int8_gflops": 2 * m * K * N / int8 / 1e6})
    table = Table(title=f"[{K} x {N}] matmul: float32 against int8 (bf16 activations), best of runs")
    for col in ("rows", "float32 ms", "int8 ms", "int8 speedup", "float32 GFLOP/s", "int8 GFLOP/s",
                "float32 vs 1 row", "int8 vs 1 row"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["rows"]), f"{r['fp32_ms']:.2f}", f"{r['int8_ms']:.2f}",
                      f"{r['fp32_ms'] / r['int8_ms']:.2f}x", f"{r['fp32_gflops']:.0f}", f"{r['int8_gflops']:.0f}",
                      f"{r['fp32_ms'] / rows[0]['fp32_ms']:.2f}x", f"{r['int8_ms'] / rows[0]['int8_ms']:.2f}x")
    console.print(table)
    out = RESULTS / "gemm_bench.json"
    out.write_text(json.dumps({"machine": machine(), "shape": [K, N], "rows": rows}, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
