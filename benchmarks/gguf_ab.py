"""The `gguf` precision's CPU kernel (kernels/csrc/gguf_linear.cpp) of the working tree against
the same kernel at a git revision, in one process: the revision's source is built beside the
tree's under another operator namespace, and the two take turns on the same blocks and
activations, with int8's kernel at each shape as a third turn. What a kernel change gains, with
the host's drift (1.5x across a day here) out of the ratio.

Layers are the Qwen models' K-quant and x4 shapes (gguf_bench.py's), each timed over copies of
its blocks larger than the L3, as a decode step reads them. Prints a table of ms per call and
the tree's speed against the revision's and int8's, and writes benchmarks/results/gguf_ab.json.

    python benchmarks/gguf_ab.py --rev HEAD~1 [--rows 1 4 8] [--repeats 9]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
from pathlib import Path

import torch
from common import RESULTS, machine, write_results
from gguf_bench import LAYERS, compiled_kernels, copies, int8_weights, measure
from rich.console import Console
from rich.table import Table

from kernels import cpu_build, gguf_quant

console = Console(width=150)
SOURCE = "kernels/csrc/gguf_linear.cpp"
ROOT = Path(__file__).resolve().parent.parent


def build_revision(rev: str) -> object:
    """The kernel's source at `rev`, built as gguf_cpu builds the tree's, under the operator
    namespace sluice_rev."""
    text = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    ops = cpu_build.build_beside("sluice_gguf_rev", Path(SOURCE).name, text, "sluice_rev", f"no baseline at {rev}",
                                 use_vnni=True)
    if ops is None:
        raise SystemExit(f"the kernel at {rev} did not build: {cpu_build.BUILDS['sluice_gguf_rev'].error}")
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the git revision whose kernel is the baseline")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layouts", nargs="+", help="only the layers served in these layouts (Q4_Kx, Q6_Kx, ...)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf_ab.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tree, int8_ops = compiled_kernels()
    rev = build_revision(args.rev)
    commit = subprocess.run(["git", "rev-parse", args.rev], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    results = []
    for name, qtype, k, n, _ in LAYERS:
        if args.layouts and gguf_quant.LAYOUTS.get(qtype, qtype) not in args.layouts:
            continue
        layout, w = gguf_quant.repack(qtype, gguf_quant.random_blocks(qtype, n, k))
        ws = copies(w, cached=False)
        int8, int8_scales = int8_weights(n, k, cached=False)
        tid = gguf_quant.TYPES[layout].id
        for m in args.rows:
            x = torch.randn(m, k)
            turns = {"tree": [], "rev": [], "int8": []}
            for _ in range(args.repeats):       # the three take turns
                for key, ops in (("tree", tree), ("rev", rev)):
                    turns[key].append(measure(lambda i: ops.gguf_linear(x, [ws[i % len(ws)]], [tid], None, 1),
                                              len(ws), 1))
                turns["int8"].append(measure(lambda i: int8_ops.int8_linear(x, int8[i % len(int8)], int8_scales, 128),
                                             len(int8), 1))
            ms = {key: 1e3 * statistics.median(v) for key, v in turns.items()}
            results.append({"layer": name, "layout": layout, "k": k, "n": n, "rows": m, "ms": ms,
                            "vs_rev": ms["rev"] / ms["tree"], "vs_int8": ms["int8"] / ms["tree"]})
            console.print(f"{name} {layout} {m} rows: tree {ms['tree']:.3f} ms, {args.rev} {ms['rev']:.3f} ms, "
                          f"int8 {ms['int8']:.3f} ms")
    table = Table(title=f"gguf_linear, the working tree against {args.rev} ({commit[:10]}), one process, "
                        f"{args.threads} threads, {machine()['isa']}, median of {args.repeats} turns")
    for col in ("layer", "layout", "rows", "tree ms", f"{args.rev} ms", "int8 ms", f"vs {args.rev}", "vs int8"):
        table.add_column(col)
    for r in results:
        table.add_row(r["layer"], r["layout"], str(r["rows"]), f"{r['ms']['tree']:.3f}", f"{r['ms']['rev']:.3f}",
                      f"{r['ms']['int8']:.3f}", f"[bold]{r['vs_rev']:.2f}x[/]", f"{r['vs_int8']:.2f}x")
    console.print(table)
    write_results(args.out, {"machine": machine(), "rev": args.rev, "commit": commit, "repeats": args.repeats,
                             "layers": results})


if __name__ == "__main__":
    main()
