"""The `gguf` precision's CPU kernel (kernels/csrc/gguf_linear.cpp) at the Qwen models' layer
shapes and types: each in the layout the engine serves (Q4_K as Q4_Kx, Q5_0 as Q5_0x4, repacked
at load: kernels/gguf_quant.py's `repack`) against the same blocks as the file stores them, and
against the float32 GEMM on the weights dequantized (torch's sgemm: what a prompt would cost on
dequantized weights, the dequantization itself not counted), and against the int8 precision's
kernel at the same shape (kernels/csrc/quant_matmul.cpp's int8_linear: int8 weights per channel,
x per 128 values), the default precision the gguf one is measured against. The K-quants are also timed with
their activations on a step per 32 values (gguf_linear's steps 8: kernels/gguf_quant.py's
quantize_steps, ModelEntry.gguf_steps) against the default one int8 scale per 256 (llama.cpp's q8_K).

Each layer is timed over enough copies of its blocks to be read from memory, not from the last
level cache, as a decode step reads its layers; rows 1 and 8 are decode, 512 a prompt. `--cached`
times one copy instead, read from the caches where it fits: a kernel as fast there as from memory
is bound by the core's instructions, not by the bytes. The
layouts and int8 take turns. It prints ms per call, the GB/s of stored weight bytes read (at 1
row, as a share of the read bandwidth), the served layout's speed against the file's, int8's and
sgemm's, and writes benchmarks/results/gguf_bench.json.

    python benchmarks/gguf_bench.py [--threads 2] [--rows 1 8 512] [--out ...]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import RESULTS, machine, memory_bandwidth_gbs, timed, write_results
from rich.console import Console
from rich.table import Table

from kernels import cpu_build, gguf_cpu, gguf_quant, quant_matmul_cpu

console = Console(width=150)
# (name, type in the file, K in, N out, the most rows it runs at in a step: the head sees a
# prompt's last row). The 1.5B's down projection is Q4_K in half its layers and Q6_K in the others
# (its v as well, timed here with q and k as Q4_K).
LAYERS = [("1.5B q|k|v", "Q4_K", 1536, 2048, 512),
          ("1.5B gate|up", "Q4_K", 1536, 8960, 512), ("1.5B down", "Q4_K", 8960, 1536, 512),
          ("1.5B down", "Q6_K", 8960, 1536, 512), ("1.5B head", "Q6_K", 1536, 151936, 8),
          ("0.5B gate|up", "Q5_0", 896, 9728, 512), ("0.5B down", "Q6_K", 4864, 896, 512),
          ("0.5B head", "Q8_0", 896, 151936, 8)]
CACHE_BYTES = 96 << 20           # copies of a layer's blocks until they exceed the L3 several times


def compiled_kernels() -> tuple:
    """The gguf and int8 kernels' operators, or an exit naming why they are not built here."""
    ops, int8_ops = gguf_cpu.load(), quant_matmul_cpu.load()
    if ops is None or int8_ops is None:
        raise SystemExit(f"the compiled kernels are not built here ({cpu_build.unable()})")
    return ops, int8_ops


def copies(w: torch.Tensor, cached: bool) -> list[torch.Tensor]:
    """w and clones of it, together past the last level cache: each call reads from memory
    (`cached`: w alone)."""
    return [w] + [w.clone() for _ in range(0 if cached else max(0, CACHE_BYTES // w.numel() - 1))]


def int8_weights(n: int, k: int, cached: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random int8 weights [n, k] for int8's kernel, copied past the cache (`cached`: one), and
    their scales."""
    return ([torch.randint(-127, 128, (n, k), dtype=torch.int8)
             for _ in range(1 if cached else max(1, CACHE_BYTES // (n * k)))], torch.rand(n) / 100)


def measure(fn, calls: int, repeats: int) -> float:
    """Median over `repeats` of the seconds per call of `calls` calls."""
    fn(0)
    return statistics.median(timed(lambda: [fn(i) for i in range(calls)]) / calls for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--types", nargs="+", choices=sorted({t for _, t, *_ in LAYERS}),
                    help="only the layers of these types (all by default)")
    ap.add_argument("--no-sgemm", action="store_true", help="time the kernel only")
    ap.add_argument("--cached", action="store_true", help="one copy of each layer's weights, read from the caches")
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops, int8_ops = compiled_kernels()
    bandwidth = memory_bandwidth_gbs()
    results = []
    for name, qtype, k, n, most in [layer for layer in LAYERS if not args.types or layer[1] in args.types]:
        w = gguf_quant.random_blocks(qtype, n, k)
        layout, _ = gguf_quant.repack(qtype, w)
        layouts = {qtype: copies(w, args.cached)}
        if layout != qtype:
            layouts[layout] = [gguf_quant.repack(qtype, c)[1] for c in layouts[qtype]]
        int8, int8_scales = int8_weights(n, k, args.cached)
        dense = gguf_quant.dequantize(w, qtype, k).t().contiguous()
        for m in [r for r in args.rows if r <= most]:
            x = torch.randn(m, k)
            calls = max(len(layouts[qtype]), 8) if m < 64 else 2
            steps = gguf_quant.MAX_STEPS
            variants = {(t, 1) for t in layouts} | ({(layout, steps)} if gguf_quant.TYPES[qtype].act > 32 else set())
            times = {v: [] for v in variants | {("int8", 1)}}
            for _ in range(args.repeats):
                for t, st in sorted(variants):
                    ws = layouts[t]
                    times[t, st].append(measure(lambda i: ops.gguf_linear(
                        x, [ws[i % len(ws)]], [gguf_quant.TYPES[t].id], None, st), calls, 1))
                times["int8", 1].append(measure(lambda i: int8_ops.int8_linear(
                    x, int8[i % len(int8)], int8_scales, 128), max(len(int8), 8) if m < 64 else 2, 1))
            s = statistics.median(times[layout, 1])
            row = {"layer": name, "type": qtype, "layout": layout, "k": k, "n": n, "rows": m,
                   "weight_gb": w.numel() / 1e9, "ms": 1e3 * s, "gb_s": w.numel() / s / 1e9,
                   "gmac_s": m * k * n / s / 1e9, "file_layout_ms": 1e3 * statistics.median(times[qtype, 1]),
                   "int8_ms": 1e3 * statistics.median(times["int8", 1])}
            if (layout, steps) in times:
                row["steps_ms"] = 1e3 * statistics.median(times[layout, steps])
            if not args.no_sgemm:
                row["sgemm_ms"] = 1e3 * measure(lambda i: x @ dense, 2, args.repeats)
            results.append(row)
            console.print(f"{name} {layout} [{k} x {n}] {m} rows: {row['ms']:.2f} ms, {row['gb_s']:.1f} GB/s"
                          f" ({qtype} as stored {row['file_layout_ms']:.2f} ms, int8 {row['int8_ms']:.2f} ms)"
                          + (f", sgemm {row['sgemm_ms']:.2f} ms" if "sgemm_ms" in row else ""))
    where = "one copy, from the caches" if args.cached else "from memory"
    table = Table(title=f"gguf_linear at the Qwen models' shapes, {where}; {args.threads} threads, {machine()['isa']}, "
                        f"build {cpu_build.BUILDS['sluice_gguf_linear'].isa}, read bandwidth {bandwidth:.1f} GB/s")
    for col in ("layer", "layout (file's)", "K x N", "rows", "ms", "weights GB/s (share)", "GMAC/s",
                "vs the file's layout", "vs int8", "steps 8 vs 1", "sgemm ms", "vs sgemm"):
        table.add_column(col)
    for r in results:
        table.add_row(r["layer"], f"{r['layout']} ({r['type']})", f"{r['k']} x {r['n']}", str(r["rows"]),
                      f"{r['ms']:.2f}", f"{r['gb_s']:.1f} ({r['gb_s'] / bandwidth:.0%})", f"{r['gmac_s']:.1f}",
                      f"{r['file_layout_ms'] / r['ms']:.2f}x", f"[bold]{r['int8_ms'] / r['ms']:.2f}x[/]",
                      f"{r['ms'] / r['steps_ms']:.2f}x" if "steps_ms" in r else "",
                      f"{r['sgemm_ms']:.2f}" if "sgemm_ms" in r else "",
                      f"[bold]{r['sgemm_ms'] / r['ms']:.2f}x[/]" if "sgemm_ms" in r else "")
    console.print(table)
    write_results(args.out, {"machine": machine() | {"read_bandwidth_gbs": bandwidth},
                             "build": cpu_build.BUILDS["sluice_gguf_linear"].isa, "cached": args.cached,
                             "layers": results})


if __name__ == "__main__":
    main()
