"""The engine's kernel choices on a CUDA GPU, timed at the served models' shapes.

Linear layers: every way the engine can run one, per layer shape and per row count (a decode
batch, a prompt chunk), and which is fastest where.

    bf16 [in,out]   the engine's dense layout (x @ weight_t), cuBLAS
    bf16 [out,in]   nn.Linear's layout (F.linear), cuBLAS
    bf16 gemv       kernels/gemv_triton.py on the engine's [in,out] layout: split-K tiles sized to
                    fill the chip (up to the largest decode bucket only)
    int8 triton     kernels/quant_matmul_triton.py (multiply-add GEMV up to 8 rows, tl.dot tiles past)
    int8 dequant    the reference twin: the whole weight dequantized to bf16, then cuBLAS
    int4 tinygemm   torch._weight_int4pack_mm, the layout QuantLinear packs on CUDA
    int4 triton     kernels/quant_matmul_triton.py on the stored format
    fp8             QuantLinear's fp8: activations rounded to e4m3 per row, then torch._scaled_mm
                    on FP8 tensor cores (compute capability 8.9 and up; below, its emulation)
    int8 gemv,      the bf16 GEMV's kernel on the int8 / e4m3 weights transposed to [in,out], widened
    fp8 gemv        in registers, each output's scale after the sum (decode buckets only; fp8 on
                    compute capability 8.9 and up)
    Q4_K triton ... kernels/gguf_quant_triton.py on a GGUF type's own blocks (random contents, the
                    layer's shape; each type whose block divides the layer's input), in the layout
                    the engine serves them in on a GPU (Q6_K, Q5_0, Q8_0 in planes: gguf_quant.to_planes)

Times are medians of CUDA-graph replays (launch overhead out, as in the engine's decode step)
over copies of the layer that together exceed the L2 cache several times (a weight read from
L2 would flatter the small layers). GB/s counts the
weight bytes each read.

Decode attention: the split-KV (flash-decoding) launch the kernel picks against one pass per
(sequence, KV head), per batch and context length, bf16 KV.

The batch-bucket table: per precision (int8, int4, fp8) and decode batch bucket (the row counts
measured up to --max-bucket), the time of one decode step's linear layers on its own kernel
against dense bf16 (F.linear on the weights dequantized once, what QuantLinear's dense copy runs)
and, for int8 and fp8, the GEMV on their own bytes, summed over every layer of the models
measured (each decoder layer's four, times the layer count, and the LM head), and the fastest.
bf16 per layer kind ("bf16.qkv", "bf16.o", ...): the Triton GEMV ("kernel") against cuBLAS on
the same [in,out] weights ("dense"), summed over the models' layers of that kind; the GEMV only
where it is faster. It goes into the results JSON and, for this device, into
engine/precision_buckets.json, which the engine reads (engine/quantize.py's bucket_ways and
apply_gemv_buckets).
`--table-from RESULTS.json` rebuilds the table from a saved run, without a GPU.

Prints tables and writes benchmarks/results/gpu_kernels-<device>.json, with the fastest way per
layer and row count and the one QuantLinear takes.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, ROOT, machine
from rich.console import Console
from rich.table import Table

from engine.quantize import (
    BUCKETS,
    DEQUANT_ROWS,
    GGUFLinear,
    QuantLinear,
    fp8_native,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from kernels import gguf_quant, quant_matmul

console = Console(width=160)
# (in, out) of each linear of a layer, and the LM head, for the served models.
SHAPES = {
    "qwen2.5-coder-0.5b": {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896),
                           "lm_head": (896, 151936)},
    "qwen2.5-coder-1.5b": {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536),
                           "lm_head": (1536, 151936)},
}
GROUP = 128
LAYERS = {"qwen2.5-coder-0.5b": 24, "qwen2.5-coder-1.5b": 28}     # decoder layers: each holds one of every linear
PRECISIONS = ("int8", "int4", "fp8")
# The shipped GGUFs' types per layer kind, (type, layers) (read from the files): Q4_K_M gives
# every other layer's v and down Q6_K. A fused q|k|v counts as its q and k's type (v is an
# eighth of its rows).
GGUF_TYPES = {
    "qwen2.5-coder-0.5b": {"qkv": [("Q5_0", 24)], "o": [("Q5_0", 24)], "gate_up": [("Q5_0", 24)],
                           "down": [("Q4_K", 12), ("Q6_K", 12)], "lm_head": [("Q8_0", 1)]},
    "qwen2.5-coder-1.5b": {"qkv": [("Q4_K", 28)], "o": [("Q4_K", 28)], "gate_up": [("Q4_K", 28)],
                           "down": [("Q4_K", 14), ("Q6_K", 14)], "lm_head": [("Q6_K", 1)]},
}


def ways(w: torch.Tensor) -> dict[str, tuple[object, int]]:
    """name -> (a callable x -> y, bytes of weight it reads), built from one float weight [out, in]."""
    from kernels import gemv_triton
    q8, s8 = quantize_int8(w)
    q4, s4, z4 = quantize_int4(w, GROUP)
    int8 = QuantLinear("int8", {"w": q8, "scales": s8}, None, GROUP, device="cuda")
    int4 = {"w": q4, "scales": s4, "zeros": z4}
    kn, nk = w.t().contiguous().to(torch.bfloat16), w.to(torch.bfloat16)
    out = {"bf16 [in,out]": (lambda x: x @ kn, kn.nbytes),
           "bf16 [out,in]": (lambda x: torch.nn.functional.linear(x, nk), nk.nbytes),
           "bf16 gemv": (lambda x: gemv_triton.gemv_linear(x, kn), kn.nbytes),
           "int8 triton": (int8, q8.nbytes + s8.nbytes),
           "int8 dequant": (lambda x: quant_matmul.int8_matmul(x, int8.w, int8.scales), q8.nbytes + s8.nbytes)}
    tiny = QuantLinear("int4", int4, None, GROUP, device="cuda")
    if tiny.packed:
        out["int4 tinygemm"] = (tiny, q4.nbytes + 2 * s4.nbytes)
    out["int4 triton"] = (QuantLinear("int4", int4, None, GROUP, packed=False, device="cuda"),
                          q4.nbytes + 2 * s4.nbytes)
    q8f, s8f = quantize_fp8(w)
    fp8 = QuantLinear("fp8", {"w": q8f, "scales": s8f}, None, GROUP, device="cuda")
    try:        # never run on a device before this check: a shape _scaled_mm refuses costs its column only
        fp8(torch.zeros(1, w.shape[1], device="cuda", dtype=torch.bfloat16))
        out["fp8"] = (fp8, q8f.nbytes + s8f.nbytes)
    except RuntimeError as e:
        console.print(f"[red]fp8 cannot run a {tuple(w.shape)} layer here: {e}[/]")
    for quant, (q, s) in (("int8", (q8, s8)), ("fp8", (q8f, s8f))):
        if quant == "int8" or fp8_native(torch.device("cuda")):     # e4m3 in Triton needs sm_89 on
            layer = QuantLinear(quant, {"w": q, "scales": s}, None, GROUP, device="cuda", ways=("gemv",) * 257)
            out[f"{quant} gemv"] = (layer, q.nbytes + s.nbytes)
    for qtype in ("Q4_K", "Q6_K", "Q5_0", "Q8_0"):      # in the layout the engine serves them in on a GPU
        if w.shape[1] % gguf_quant.TYPES[qtype].block == 0:
            layout, blocks = gguf_quant.to_planes(qtype, gguf_quant.random_blocks(qtype, *w.shape))
            out[f"{qtype} triton"] = (GGUFLinear([(layout, blocks)], None, device="cuda", triton_rows=1 << 30),
                                      blocks.nbytes)
    return out


def median_us(fns: list, x: torch.Tensor | None) -> float:
    """Median time of one call replayed from a CUDA graph (so launch overhead stays out),
    cycling through `fns` (copies of one layer; called with `x`, or with nothing when None)."""
    import triton.testing

    def run() -> None:
        for f in fns:
            f(x) if x is not None else f()
    run()                                   # compiles and allocates before the graph captures
    return 1e3 * triton.testing.do_bench_cudagraph(run, rep=5, return_mode="median") / len(fns)


# Query heads, KV heads and head size of the served models.
ATTENTION = {"qwen2.5-coder-0.5b": (14, 2, 64), "qwen2.5-coder-1.5b": (12, 2, 128)}


def attention_table(models: list[str], batches: list[int], contexts: list[int], block_size: int = 16) -> dict:
    """µs of one decode attention call, the kernel's own split choice against one pass."""
    from kernels import attention_triton
    table = Table(title="Decode attention, bf16 KV: µs per call (split-KV automatic / one pass)")
    for col in ("model", "batch", *(f"context {c}" for c in contexts)):
        table.add_column(col)
    out = {}
    for model in models:
        heads, kvh, dh = ATTENTION[model]
        out[model] = {}
        for batch in batches:
            cells = []
            for ctx in contexts:
                width = -(-ctx // block_size)
                cache = [torch.randn(batch * width, block_size, kvh, dh, device="cuda", dtype=torch.bfloat16)
                         for _ in range(2)]
                tables = torch.randperm(batch * width, device="cuda").view(batch, width)
                lens = torch.full((batch,), ctx, device="cuda")
                q = torch.randn(batch, heads, dh, device="cuda", dtype=torch.bfloat16)
                times = {name: median_us([lambda s=splits: attention_triton.paged_decode_attention(
                    q, *cache, tables, lens, dh ** -0.5, num_splits=s)], None)
                    for name, splits in (("auto", None), ("one pass", 1))}
                out[model][f"{batch}x{ctx}"] = times
                cells.append(f"{times['auto']:.1f} / {times['one pass']:.1f}")
            table.add_row(model, str(batch), *cells)
    console.print(table)
    return out


def engine_way(quant: str, rows: int) -> str:
    """The way QuantLinear runs a bf16 model's layer of `quant` for `rows` rows on CUDA, on its
    own kernel (the bucket table aside)."""
    if quant in ("int4", "fp8"):
        return "int4 tinygemm" if quant == "int4" else "fp8"
    return "int8 dequant" if rows >= DEQUANT_ROWS["cuda"] else "int8 triton"


def ways_at(layer: dict, rows: int) -> dict:
    """A layer's timings per way at `rows` rows (a run's own keys are ints, a saved one's strings)."""
    return (layer.get("rows", {}).get(rows) or layer.get("rows", {}).get(str(rows)) or {}).get("ways", {})


def bucket_table(models: dict, max_bucket: int) -> dict:
    """Per precision and decode batch bucket: µs of one step's linear layers on the precision's
    kernel, on dense bf16 and (int8, fp8) on the GEMV, summed over the models' layers, and the
    fastest (the kernel on a tie; the GEMV only where measured at every layer)."""
    table: dict[str, dict] = {}
    for quant in PRECISIONS:
        table[quant] = {}
        rows = sorted({int(r) for layers in models.values() for layer in layers.values() for r in layer["rows"]})
        for r in (r for r in rows if r <= max_bucket):
            cell = {"kernel_us": 0.0, "dense_us": 0.0, "gemv_us": 0.0}
            gemv = True
            for model, layers in models.items():
                for name, layer in layers.items():
                    ways = ways_at(layer, r)
                    if engine_way(quant, r) not in ways or "bf16 [out,in]" not in ways:
                        continue
                    count = 1 if name == "lm_head" else LAYERS[model]
                    cell["kernel_us"] += count * ways[engine_way(quant, r)]["us"]
                    cell["dense_us"] += count * ways["bf16 [out,in]"]["us"]
                    if f"{quant} gemv" in ways:
                        cell["gemv_us"] += count * ways[f"{quant} gemv"]["us"]
                    gemv = gemv and f"{quant} gemv" in ways
            if not gemv:
                del cell["gemv_us"]
            if cell["kernel_us"] and cell["dense_us"]:
                cell["pick"] = min((w for w in ("kernel", "gemv", "dense") if f"{w}_us" in cell),
                                   key=lambda w: cell[f"{w}_us"])
                table[quant][str(r)] = cell
    for kind in sorted({name for layers in models.values() for name in layers}):
        quant = f"bf16.{kind}"
        table[quant] = {}
        for model, layers in models.items():
            for r, row in (layers.get(kind) or {}).get("rows", {}).items():
                ways = row.get("ways", {})
                if int(r) > max_bucket or "bf16 gemv" not in ways or "bf16 [in,out]" not in ways:
                    continue
                count = 1 if kind == "lm_head" else LAYERS[model]
                cell = table[quant].setdefault(str(int(r)), {"kernel_us": 0.0, "dense_us": 0.0})
                cell["kernel_us"] += count * ways["bf16 gemv"]["us"]
                cell["dense_us"] += count * ways["bf16 [in,out]"]["us"]
        for cell in table[quant].values():     # cuBLAS, as without the table, unless the GEMV is faster
            cell["pick"] = "kernel" if cell["kernel_us"] < cell["dense_us"] else "dense"
    return {quant: t for quant, t in table.items() if t}


def gguf_step(models: dict, rows: int = 1) -> dict:
    """Issue 52's target per model: one decode step's linear layers at `rows` rows on the GGUF
    file's own blocks (kernels/gguf_quant_triton.py, each layer at its type in the file) against
    bf16's faster way per layer (cuBLAS or the GEMV), µs; the target is bf16 / gguf >= 2.0. A
    model with a type or a layer kind not timed gets no figure."""
    out = {}
    for model, kinds in GGUF_TYPES.items():
        ways = {kind: ways_at(models.get(model, {}).get(kind, {}), rows) for kind in kinds}
        dense = {kind: [w[way]["us"] for way in ("bf16 [in,out]", "bf16 gemv") if way in w] for kind, w in ways.items()}
        if not all(dense.values()) or any(f"{t} triton" not in ways[kind] for kind, parts in kinds.items()
                                          for t, _ in parts):
            continue
        gguf = sum(n * ways[kind][f"{t} triton"]["us"] for kind, parts in kinds.items() for t, n in parts)
        bf16 = sum(sum(n for _, n in parts) * min(dense[kind]) for kind, parts in kinds.items())
        out[model] = {"rows": rows, "gguf_us": gguf, "bf16_us": bf16, "speedup": bf16 / gguf}
    return out


def show_gguf(step: dict, device: str) -> None:
    if not step:        # a run without the GGUF types' columns
        return
    t = Table(title=f"The GGUF files' blocks on {device}: a decode step's linear layers at 1 row (target 2.0x bf16)")
    for col in ("model", "gguf µs", "bf16 µs", "bf16 / gguf"):
        t.add_column(col)
    for model, r in step.items():
        t.add_row(model, f"{r['gguf_us']:.0f}", f"{r['bf16_us']:.0f}", f"{r['speedup']:.2f}x")
    console.print(t)


def show_buckets(table: dict, device: str) -> None:
    t = Table(title=f"Batch buckets on {device}: one decode step's linear layers, µs on the precision's kernel / "
                    f"dense bf16 / (int8, fp8) the GEMV on its own bytes (bf16.<layer>: the Triton GEMV / cuBLAS); "
                    f"the pick in bold")
    buckets = sorted({int(b) for q in table.values() for b in q})
    for col in ("precision", *map(str, buckets)):
        t.add_column(col)
    for quant, rows in table.items():
        t.add_row(quant, *[" / ".join(f"[bold]{c[w + '_us']:.0f}[/]" if c["pick"] == w else f"{c[w + '_us']:.0f}"
                                      for w in ("kernel", "dense", "gemv") if w + "_us" in c)
                           if (c := rows.get(str(b))) else "-" for b in buckets])
    console.print(t)


def record_buckets(table: dict, device: str, source: str, torch_version: str, path: Path) -> None:
    """This device's picks into the engine's table file (other devices' entries kept)."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("devices", {})[device] = {
        "source": source, "torch": torch_version,
        "buckets": {quant: {b: c["pick"] for b, c in rows.items()} for quant, rows in table.items()}}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 16, 64], help="decode attention (none: skip it)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 2048], help="decode attention")
    ap.add_argument("--max-bucket", type=int, default=64, help="the largest decode batch bucket the table holds")
    ap.add_argument("--table", type=Path, default=BUCKETS, help="the engine's table file this device's picks go to")
    ap.add_argument("--table-from", type=Path, help="rebuild the table from a saved gpu_kernels JSON (no GPU)")
    args = ap.parse_args()
    if args.table_from:
        saved = json.loads(args.table_from.read_text())
        device = saved["machine"]["device"]
        table = bucket_table(saved["models"], args.max_bucket)
        show_buckets(table, device)
        show_gguf(gguf_step(saved["models"]), device)
        record_buckets(table, device, str(args.table_from), saved["machine"].get("torch", ""), args.table)
        console.print(f"wrote {args.table}")
        return
    if not torch.cuda.is_available():
        sys.exit(f"gpu_kernels needs a CUDA GPU, and torch {torch.__version__} sees none here")
    device = torch.cuda.get_device_name()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = {"machine": machine() | {"device": device, "torch": torch.__version__, "l2_bytes": l2,
                                       "fp8_tensor_cores": fp8_native(torch.device("cuda"))},
               "dequant_rows": DEQUANT_ROWS["cuda"], "models": {}}
    table = Table(title=f"Linear layers on {device}: µs per call (GB/s of weight read), fastest in bold")
    for col in ("model", "layer", "rows", "bf16 [in,out]", "bf16 [out,in]", "bf16 gemv", "gemv vs cuBLAS",
                "int8 triton", "int8 dequant", "int8 gemv", "int4 tinygemm", "int4 triton", "fp8", "fp8 gemv",
                "int8 / int4 engine"):
        table.add_column(col)
    for model, shapes in SHAPES.items():
        if model not in args.models:
            continue
        results["models"][model] = {}
        for layer, (k, n) in shapes.items():
            start = time.perf_counter()
            torch.manual_seed(0)
            # Copies with their own weights, so that the smallest form outgrows L2 twice, or 16 of
            # them for layers under L2 / 8, whose figures are then partly L2's (said in the JSON).
            copies = min(16, math.ceil(2 * l2 / (n * k // 2)))
            sets = [ways(torch.randn(n, k, device="cuda") / k ** 0.5) for _ in range(copies)]
            rows_out = {}
            for rows in args.rows:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                times = {}
                for name, (_, nbytes) in sets[0].items():
                    if name.endswith(" gemv") and rows > args.max_bucket:     # not a decode batch
                        continue
                    us = median_us([s[name][0] for s in sets], x)
                    times[name] = {"us": us, "gb_s": nbytes / (us * 1e3)}
                best = min(times, key=lambda t: times[t]["us"])
                picks = {q: engine_way(q, rows) for q in PRECISIONS}
                rows_out[rows] = {"ways": times, "fastest": best, "engine": picks}
                cells = [(f"[bold]{t['us']:.1f}[/] ({t['gb_s']:.0f})" if name == best else
                          f"{t['us']:.1f} ({t['gb_s']:.0f})") if (t := times.get(name)) else "-"
                         for name in ("bf16 [in,out]", "bf16 [out,in]", "bf16 gemv", "int8 triton", "int8 dequant",
                                      "int8 gemv", "int4 tinygemm", "int4 triton", "fp8", "fp8 gemv")]
                # cuBLAS's time over the GEMV's on the same weights: above 1, the GEMV is faster.
                ratio = (f"{times['bf16 [in,out]']['us'] / times['bf16 gemv']['us']:.2f}x"
                         if "bf16 gemv" in times else "-")
                table.add_row(model, layer, str(rows), *cells[:3], ratio, *cells[3:],
                              f"{picks['int8']} / {picks['int4']}")
            results["models"][model][layer] = {"in": k, "out": n, "copies": copies,
                                               "int4_copies_over_l2": copies * n * k / 2 / l2, "rows": rows_out}
            save(results, device)
            # The table prints at the end: a line per layer shows a time-limited run's progress.
            console.print(f"{model} {layer}: {len(args.rows)} row counts in {time.perf_counter() - start:.0f} s")
            del sets
            torch.cuda.empty_cache()
    console.print(table)
    results["buckets"] = bucket_table(results["models"], args.max_bucket)
    show_buckets(results["buckets"], device)
    results["gguf_step"] = gguf_step(results["models"])
    show_gguf(results["gguf_step"], device)
    out = save(results, device)
    record_buckets(results["buckets"], device, str(out.relative_to(ROOT)), torch.__version__, args.table)
    console.print(f"wrote {args.table}")
    if args.batches:
        results["attention"] = attention_table(args.models, args.batches, args.contexts)
    console.print(f"wrote {save(results, device)}")


def save(results: dict, device: str):
    """Written as each layer finishes, so a run cut short by its time limit keeps what it measured."""
    out = RESULTS / f"gpu_kernels-{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


if __name__ == "__main__":
    main()
