"""What the GGUF blocks' Triton kernel costs an SM per byte it reads, compiled for a GPU, without one.

A decode step's matmul keeps up with the GPU's memory only if an SM issues its instructions for a
kilobyte of weights in fewer cycles than the memory takes to deliver that kilobyte (an H200:
4.8 TB/s over 132 SMs at 1.98 GHz, 18.4 bytes an SM-cycle, 56 cycles a KB). This compiles the
kernel exactly as kernels/gguf_quant_triton.py launches it at one row (Triton's own ptxas, for
sm_90), finds its main loop in the machine code (cuobjdump), and counts the instructions a loop
pass issues per KB of weights it reads; the same for the bf16 GEMV (kernels/gemv_triton.py) on
the same layer, the baseline. An SM issues four warp instructions a cycle; an integer-to-float
conversion (I2F) occupies its pipe for two SM-cycles, so the estimate is the larger of the two
(I2FP, which the previous form used for its weights, counts as an ordinary instruction: if it
is slower, that form's count is too low, not this one's).
A static count, not a time: stalls on memory and occupancy come on top (the kernel's previous
form counts 0.062 SM-cycles a Q4_K weight here, gguf_sass-sm90-second-form.json, and took 0.12
on the LM head and 0.23 on gate|up on an H200, gpu_kernels-nvidia-h200.json).

    python benchmarks/gguf_sass.py [--layer gate_up] [--block-n 32] [--out ...]

Prints a table and writes benchmarks/results/gguf_sass-sm90.json, with each loop's loads from
global memory by kind and width.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

import torch
import triton
from common import RESULTS, write_results
from gpu_kernels import SHAPES
from rich.console import Console
from rich.table import Table

from kernels import gemv_triton, gguf_quant, gguf_quant_triton
from kernels.triton_offline import Record, compile_launch

LAYERS = SHAPES["qwen2.5-coder-1.5b"]            # (inputs, outputs) of each of its layers
SMS, CLOCK_GHZ, HBM_TB_S = 132, 1.98, 4.8           # an H200's (SMS: the launch's grid)


def main_loop(cubin: bytes, scratch: Path) -> list[str]:
    """The opcodes, modifiers included, of the cubin's longest backward branch's body (the K
    loop), one per warp instruction."""
    scratch.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(scratch)], capture_output=True, text=True, check=True).stdout
    code = [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(target, 16), at) for at, text in code if "BRA" in text
             for target in re.findall(r"0x([0-9a-f]+)", text)[-1:] if int(target, 16) < at]
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for at, text in code if start <= at <= end]


def cost(opcodes: list[str], warps: int, weights: int, nbytes: int) -> dict:
    """SM-cycles per KB of weights for a loop pass that reads `weights` weights in `nbytes` bytes,
    and the pass's loads from global memory by kind (LDGSTS: an asynchronous copy to shared
    memory, which a pipeline stage issues ahead of its use; LDG: a load into registers; the
    suffix its width)."""
    ops = collections.Counter(op.split(".")[0] for op in opcodes)
    issue = warps * sum(ops.values()) / 4               # four schedulers, one warp instruction a cycle each
    convert = warps * ops["I2F"] * 2                     # 16 conversions a cycle an SM
    cycles = max(issue, convert)
    return {"instructions": sum(ops.values()), "i2f": ops["I2F"], "weights_per_pass": weights,
            "cycles_per_kb": cycles * 1024 / nbytes, "cycles_per_weight": cycles / weights,
            "top": dict(ops.most_common(8)),
            "global_loads": dict(collections.Counter(op for op in opcodes
                                                     if op.startswith("LDG") and op != "LDGDEPBAR"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer", choices=LAYERS, default="gate_up")
    ap.add_argument("--block-n", type=int, help="the GGUF kernel's outputs per program (default: its own)")
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf_sass-sm90.json")
    args = ap.parse_args()
    tile = {} if args.block_n is None else {"block_n": args.block_n}
    K, N = LAYERS[args.layer]
    gemv_triton.programs_to_fill = lambda device: 2 * SMS
    launches: list = []
    gguf_quant_triton._gguf_kernel = Record(gguf_quant_triton._gguf_kernel, launches)
    gemv_triton._gemv_kernel = Record(gemv_triton._gemv_kernel, launches)
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    gemv_triton.gemv_linear(x, torch.zeros(K, N, dtype=torch.bfloat16))
    names = ["bf16 GEMV"]
    # Each file type as stored, and the GPU's planar layout of those that have one (the engine's).
    for qtype in gguf_quant.FILE_TYPES + tuple(gguf_quant.PLANAR):
        if K % gguf_quant.TYPES[gguf_quant.PLANAR.get(qtype, qtype)].block == 0:
            w = torch.zeros(N, gguf_quant.row_bytes(qtype, K), dtype=torch.uint8)
            gguf_quant_triton.gguf_matmul(x, w, qtype, **tile)
            names.append(qtype)
    hbm = HBM_TB_S * 1e12 / (SMS * CLOCK_GHZ * 1e9)        # bytes an SM-cycle
    results = {"target": "sm_90", "triton": triton.__version__, "layer": args.layer, "shape": [K, N], "rows": 1,
               "block_n": args.block_n, "hbm_cycles_per_kb": 1024 / hbm, "kernels": {}}
    scratch = RESULTS / ".gguf_sass.cubin"
    for name, (kernel, a, kw) in zip(names, launches):
        compiled = compile_launch(kernel, a, kw, 90)
        ops = main_loop(compiled.asm["cubin"], scratch)
        const = dict(zip(kernel.arg_names, a), **kw)
        if name == "bf16 GEMV":
            weights, nbytes = const["BLOCK_N"] * const["BLOCK_K"], 2 * const["BLOCK_N"] * const["BLOCK_K"]
        else:
            t, blocks = gguf_quant.TYPES[gguf_quant.PLANAR.get(name, name)], const["BLOCK_N"] * const.get("GROUP", 1)
            weights, nbytes = blocks * t.block, blocks * t.nbytes
        results["kernels"][name] = cost(ops, kw.get("num_warps", 4), weights, nbytes) | {"block_n": const["BLOCK_N"]}
    scratch.unlink(missing_ok=True)

    base = results["kernels"]["bf16 GEMV"]
    table = Table(title=f"Instructions per KB read, compiled for sm_90, 1 row, the 1.5B's {args.layer} "
                        f"[{K}, {N}] (an H200's HBM delivers a KB in {results['hbm_cycles_per_kb']:.0f} SM-cycles)")
    for col in ("kernel", "tile", "warp instr / pass", "I2F / pass", "SM-cycles / KB", "vs HBM",
                "SM-cycles / weight", "vs bf16 GEMV / weight"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for name, r in results["kernels"].items():
        r["vs_hbm"] = r["cycles_per_kb"] / results["hbm_cycles_per_kb"]
        r["vs_bf16_per_weight"] = r["cycles_per_weight"] / base["cycles_per_weight"]
        table.add_row(name, f"{r['block_n']} x {r['weights_per_pass'] // r['block_n']}", str(r["instructions"]),
                      str(r["i2f"]), f"{r['cycles_per_kb']:.0f}", f"{r['vs_hbm']:.2f}x",
                      f"{r['cycles_per_weight']:.4f}", f"{r['vs_bf16_per_weight']:.2f}x")
    Console().print(table)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
