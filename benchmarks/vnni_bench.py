"""The compiled integer kernels built for AVX2 against the same built with AVX-512 VNNI's byte
dot products (kernels/cpu_build.py; SLUICE_CPU_VNNI=0 is the switch), on this host, and in the
VNNI build int8's register tiles for prompts (tile8, from 16 rows) against its row kernel alone.

Both builds register the same operators, so each runs in its own process; the two take turns,
`--rounds` times, each round timing the 1.5B's MLP up projection ([1536 x 8960], weights in
cache: the kernels' arithmetic, not the memory's) at int8 and int4, and on GGUF blocks in the
layouts the gguf precision serves (Q4_Kx, Q6_Kx, Q5_0x4, Q8_0x4: gguf_linear in VNNI's form,
kernels/csrc/common.h), over 1, 8, 64 and 512 rows, best of several calls. The table gives each
build's best over its rounds and VNNI's speedup. The outputs are equal to the bit
(tests/test_kernels.py and tests/test_gguf_blocks.py compare the two forms).

    python benchmarks/vnni_bench.py [--rounds 3] [--threads 2] [--out benchmarks/results/vnni_bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from common import RESULTS, machine, timed, write_results
from rich.console import Console
from rich.table import Table

from engine.quantize import quantize_int4, quantize_int8
from kernels import cpu_build, gguf_cpu, gguf_quant, quant_matmul_cpu

K, N, ROWS = 1536, 8960, (1, 8, 64, 512)


def measure(threads: int) -> dict[str, float]:
    """One build's best ms per (weights, rows), in this process."""
    torch.set_num_threads(threads)
    ops, gguf_ops = quant_matmul_cpu.load(), gguf_cpu.load()
    torch.manual_seed(0)
    gguf = [gguf_quant.repack(t, gguf_quant.random_blocks(t, N, K)) for t in gguf_quant.LAYOUTS]   # as served
    q8, s8 = quantize_int8(torch.randn(N, K) * 0.02)
    q4, s4, z4 = quantize_int4(torch.randn(N, K) * 0.02, 128)
    zs = (z4 * s4).contiguous()
    out = {}
    for m in ROWS:
        x = torch.randn(m, K)
        ways = [("int8", lambda: ops.int8_linear(x, q8, s8, 128)),
                ("int4", lambda: ops.int4_linear(x, q4, s4, zs, 128))]
        ways += [(layout, lambda w=w, t=gguf_quant.TYPES[layout].id: gguf_ops.gguf_linear(x, [w], [t], None, 1))
                 for layout, w in gguf]
        for name, fn in ways:
            fn()
            out[f"{name} {m}"] = 1e3 * min(timed(fn) for _ in range(5 if m > 64 else 30))
        if cpu_build.vnni():
            was = ops.set_tile_rows(1 << 30)
            out[f"untiled {m}"] = 1e3 * min(timed(lambda: ops.int8_linear(x, q8, s8, 128))
                                            for _ in range(5 if m > 64 else 30))
            ops.set_tile_rows(was)
            out["tile_rows"] = was
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=RESULTS / "vnni_bench.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads)))
        return
    if not torch.cpu._is_vnni_supported():
        print("vnni_bench: this CPU has no AVX-512 VNNI; nothing to compare")
        sys.exit(2)
    builds = {"AVX2": "0", "VNNI": "1"}
    best: dict[str, dict[str, float]] = {b: {} for b in builds}
    for r in range(args.rounds):
        for build, flag in builds.items():
            done = subprocess.run([sys.executable, __file__, "--child", "--threads", str(args.threads)],
                                  env=os.environ | {"SLUICE_CPU_VNNI": flag}, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-2000:])
                sys.exit(f"vnni_bench: the {build} build failed (exit {done.returncode})")
            for key, ms in json.loads(done.stdout.strip().splitlines()[-1]).items():
                best[build][key] = min(ms, best[build].get(key, ms))
            print(f"round {r + 1} {build}: done", flush=True)
    table = Table(title=f"[{K} x {N}] integer matmul, ms (best of {args.rounds} rounds), {args.threads} threads")
    for col in ("weights", "rows", "AVX2 build", "VNNI build", "VNNI speedup", "VNNI, int8 untiled", "tiles' speedup"):
        table.add_column(col)
    rows = []
    tile_rows = best["VNNI"].pop("tile_rows")
    for key in best["AVX2"]:
        weights, m = key.split()
        a, v = best["AVX2"][key], best["VNNI"][key]
        u = best["VNNI"][f"untiled {m}"] if weights == "int8" and int(m) >= tile_rows else None
        rows.append({"weights": weights, "rows": int(m), "avx2_ms": a, "vnni_ms": v, "speedup": a / v,
                     "vnni_untiled_ms": u, "tile_speedup": u and u / v})
        table.add_row(weights, m, f"{a:.3f}", f"{v:.3f}", f"[bold]{a / v:.2f}x[/]",
                      *((f"{u:.3f}", f"[bold]{u / v:.2f}x[/]") if u else ("", "")))
    Console(width=120).print(table)
    write_results(args.out, {"machine": machine(), "shape": [K, N], "rounds": args.rounds, "tile_rows": tile_rows,
                             "rows": rows})


if __name__ == "__main__":
    main()
