"""The matmul under every quantized Linear on this CPU, three ways: the float32 GEMM on the
transposed weight (the engine's float path), torch's packed int8 op with bf16 activations, and
integer dot products (activations quantized to int8, as llama.cpp's q8 activations, int32
sums; that quantization is in the time) on what the engine uses for them on this CPU: the
compiled kernel (kernels/quant_matmul_cpu.py, a scale per 128 activations), else torch's
`_int_mm` (a scale per row).

Two tables: one of Qwen2.5-Coder-1.5B's layers from decode's 1 row to prefill's 512 (what a
batch of rows costs against one: batched decode and speculative verification pay it); and a
whole decode step's quantized matmuls for both Qwen models, int8 and int4 (the engine's
QuantLinear layers, every one with its own weights as in the model, so they stream from memory
as a real step's do; the LM head included), torch's packed op against dot products, at 1 and 8
rows, with the GB/s of weights read (int8 on a VNNI host also on `_int_mm`, the engine's way
there before the compiled kernel measured faster); on the compiled kernels once per `--prefetch` distance
(bytes ahead of their loads that they ask for weights; 0: the hardware's prefetchers alone),
the ways taking turns, best and median of the steps.

    python benchmarks/gemm_bench.py [--threads 2] [--prefetch 0 2048] [--out benchmarks/results/gemm_bench.json]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import RESULTS, machine, memory_bandwidth_gbs, timed, write_results
from rich.console import Console
from rich.table import Table

from engine.quantize import QuantLinear, dot_matmul, quantize_int4, quantize_int8
from kernels import quant_matmul_cpu
from kernels.quant_matmul import act_block, int8_int8_matmul

DOT = dot_matmul("int8", 128) or int8_int8_matmul
DOT_NAME = "_int_mm" if DOT is int8_int8_matmul else "the compiled kernel"

console = Console(width=150)
K, N = 1536, 8960            # the 1.5B's MLP up projection (one half of gate_up)
BLOCK = 0 if DOT is int8_int8_matmul else act_block(K)     # as QuantLinear picks it
ROWS = (1, 2, 4, 8, 16, 128, 512)
VOCAB = 151936
# (hidden, intermediate, layers, q heads, kv heads, head dim) of the served models.
MODELS = {"qwen2.5-coder-0.5b": (896, 4864, 24, 14, 2, 64), "qwen2.5-coder-1.5b": (1536, 8960, 28, 12, 2, 128)}


def best_ms(fn, repeats: int) -> float:
    fn()
    return 1e3 * min(timed(fn) for _ in range(repeats))


def layer_rows() -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(N, K)
    q, scales = quantize_int8(w)
    scales_bf16, w_t = scales.to(torch.bfloat16), w.t().contiguous()
    rows = []
    for m in ROWS:
        x = torch.randn(m, K)
        repeats = 5 if m > 100 else 30
        fp32 = best_ms(lambda: x @ w_t, repeats)
        packed = best_ms(lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scales_bf16).float(), repeats)
        dot = best_ms(lambda: DOT(x, q, scales, BLOCK), repeats)
        rows.append({"rows": m, "fp32_ms": fp32, "int8_ms": packed, "int8_dot_ms": dot,
                     "fp32_gflops": 2 * m * K * N / fp32 / 1e6, "int8_gflops": 2 * m * K * N / packed / 1e6,
                     "int8_dot_gflops": 2 * m * K * N / dot / 1e6})
        if DOT is not int8_int8_matmul and torch.cpu._is_vnni_supported():
            rows[-1]["int_mm_ms"] = best_ms(lambda: int8_int8_matmul(x, q, scales, 0), repeats)
    return rows


def step_shapes(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int):
    """(in, out, count) of every int8 matmul of one decode step."""
    return [(hidden, (heads + 2 * kv_heads) * head_dim, layers), (heads * head_dim, hidden, layers),
            (hidden, 2 * inter, layers), (inter, hidden, layers), (hidden, VOCAB, 1)]


def decode_steps(prefetch: list[int], batches: tuple[int, ...] = (1, 8), repeats: int = 7) -> list[dict]:
    """Each model's decode-step matmuls, int8 and int4, packed against dot products (once per
    prefetch distance on the compiled kernels): best and median of `repeats` whole steps, the ways
    taking turns."""
    compiled = DOT is not int8_int8_matmul and quant_matmul_cpu.load() is not None
    dot_ways = [(f"dot, prefetch {p}", p) for p in prefetch] if compiled else [("dot", None)]
    served = torch.ops.sluice.set_prefetch(prefetch[-1]) if compiled else None
    out = []
    for name, dims in MODELS.items():
        shapes = [(k, n) for k, n, count in step_shapes(*dims) for _ in range(count)]
        for mode in ("int8", "int4"):
            if dot_matmul(mode, 128) is None:
                continue
            torch.manual_seed(0)
            layers: dict[str, list[QuantLinear]] = {"packed": [], "dot": []}
            for k, n in shapes:
                w = torch.randn(n, k) * 0.02
                tensors = dict(zip(("w", "scales"), quantize_int8(w))) if mode == "int8" else \
                    dict(zip(("w", "scales", "zeros"), quantize_int4(w, 128)))
                layers["packed"].append(QuantLinear(mode, tensors, None, 128))
                layers["dot"].append(QuantLinear(mode, tensors, None, 128, dot_rows=1))
            # int4: half a byte a weight, and a float32 scale and zero per 128.
            read = sum(k * n for k, n in shapes) * (1 if mode == "int8" else 0.5 + 8 / 128)
            ways = [("packed", layers["packed"], None)] + [(way, layers["dot"], p) for way, p in dot_ways]
            if mode == "int8" and compiled and torch.cpu._is_vnni_supported():
                ways.append(("_int_mm", [lambda x, l=layer: int8_int8_matmul(x, l.w, l.dot_scales, 0)
                                         for layer in layers["dot"]], None))
            for m in batches:
                xs = {k: torch.randn(m, k) for k, _ in shapes}
                times: dict[str, list[float]] = {way: [] for way, *_ in ways}
                for _ in range(repeats):
                    for way, step, ahead in ways:
                        if ahead is not None:
                            torch.ops.sluice.set_prefetch(ahead)
                        times[way].append(timed(lambda: [layer(xs[k]) for layer, (k, _) in zip(step, shapes)]))
                ms = {way: 1e3 * min(t) for way, t in times.items()}
                median = {way: 1e3 * statistics.median(t) for way, t in times.items()}
                dot = dot_ways[-1][0]
                out.append({"model": name, "weights": mode, "rows": m, "weight_gb": read / 1e9, "ms": ms,
                            "median_ms": median, "gb_s": {k: read / v / 1e6 for k, v in ms.items()},
                            "median_gb_s": {k: read / v / 1e6 for k, v in median.items()},
                            "dot_speedup": ms["packed"] / ms[dot]})
                console.print(f"{name} {mode}, {m} rows, median ms: "
                              + ", ".join(f"{way} {t:.1f}" for way, t in median.items()))
    if compiled:
        torch.ops.sluice.set_prefetch(served)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 2048],
                    help="bytes ahead that the compiled kernels prefetch weights, each measured (default: none "
                         "and the kernels' own); the last is the one the speedup over packed is quoted for")
    ap.add_argument("--out", type=Path, default=RESULTS / "gemm_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = memory_bandwidth_gbs()
    isa = machine()["isa"]
    rows = layer_rows()
    table = Table(title=f"[{K} x {N}] matmul, best of runs, {args.threads} threads, {isa}, dot products on {DOT_NAME}")
    for col in ("rows", "float32 ms", "int8 packed ms", "int8 dot ms", "_int_mm ms", "packed speedup", "dot speedup",
                "float32 GFLOP/s", "dot GFLOP/s", "float32 vs 1 row", "dot vs 1 row"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["rows"]), f"{r['fp32_ms']:.2f}", f"{r['int8_ms']:.2f}", f"{r['int8_dot_ms']:.2f}",
                      f"{r['int_mm_ms']:.2f}" if "int_mm_ms" in r else "",
                      f"{r['fp32_ms'] / r['int8_ms']:.2f}x", f"{r['fp32_ms'] / r['int8_dot_ms']:.2f}x",
                      f"{r['fp32_gflops']:.0f}", f"{r['int8_dot_gflops']:.0f}",
                      f"{r['fp32_ms'] / rows[0]['fp32_ms']:.2f}x", f"{r['int8_dot_ms'] / rows[0]['int8_dot_ms']:.2f}x")
    console.print(table)
    steps = decode_steps(args.prefetch)
    table = Table(title=f"A decode step's quantized matmuls (LM head in), packed op against dot products (int8 on "
                        f"{DOT_NAME}, int4 on the compiled kernel); read bandwidth {bandwidth:.1f} GB/s, "
                        f"{args.threads} threads, {isa}")
    for col in ("model", "weights", "rows", "weights GB", "way", "best ms", "median ms", "GB/s at best (share)",
                "GB/s at median (share)", "median vs packed"):
        table.add_column(col)
    for r in steps:
        for way, ms in r["ms"].items():
            best, median = r["gb_s"][way], r["median_gb_s"][way]
            table.add_row(r["model"], r["weights"], str(r["rows"]), f"{r['weight_gb']:.2f}", way, f"{ms:.1f}",
                          f"{r['median_ms'][way]:.1f}", f"{best:.1f} ({best / bandwidth:.0%})",
                          f"{median:.1f} ({median / bandwidth:.0%})",
                          f"[bold]{r['median_ms']['packed'] / r['median_ms'][way]:.2f}x[/]")
    console.print(table)
    write_results(args.out, {"machine": machine() | {"read_bandwidth_gbs": bandwidth}, "dot_products": DOT_NAME,
                             "shape": [K, N],
                             "prefetch": args.prefetch, "rows": rows, "decode_steps": steps})


if __name__ == "__main__":
    main()
