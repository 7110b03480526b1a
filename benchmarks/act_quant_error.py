"""What rounding the activations to int8 costs each projection, by how many values share a
scale: the integer kernels' inputs, with int8 weights, against the same weights on float32
activations. The model runs in float32 over a fixed SQuAD text; every projection's input is
rounded with one scale per row (`_int_mm`'s way), per block of 128 (the compiled int8 kernel's)
and per 32 (llama.cpp's q8_0), and the relative error of the output (its norm over the exact
output's) is averaged per kind of projection. Prints a table and writes
benchmarks/results/act_quant_error.json.

The data is read from $SLUICE_DATA or ../shared/data (never copied into the repository).
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from common import RESULTS, ROOT, machine, write_results
from rich.console import Console
from rich.table import Table

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.model import Linear, Module
from engine.quantize import quantize_int8
from kernels.quant_matmul import quantize_rows

BLOCKS = {"row": 0, "128": 128, "32": 32}
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Probe(Module):
    """Runs its Linear unchanged and adds each rounding's relative error to `errors`."""

    def __init__(self, inner: Linear, errors: dict[str, list[float]]):
        super().__init__()
        self.inner, self.errors = inner, errors
        q, s = quantize_int8(inner.weight_t.t().contiguous())
        self.w = (q.float() * s[:, None]).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        exact = x @ self.w
        for name, block in BLOCKS.items():
            xq, scale = quantize_rows(x, block)
            rounded = (xq.float().view(x.shape[0], -1, block or x.shape[1]) * scale[..., None]).view_as(x)
            self.errors[name].append(((rounded @ self.w - exact).norm() / exact.norm()).item())
        return self.inner(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("SLUICE_DATA", ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", type=Path, default=RESULTS / "act_quant_error.json")
    args = ap.parse_args()
    articles = json.loads((args.data / "squad-v1.1-dev-part-a.json").read_text())["data"]
    text = "\n\n".join(p["context"] for a in articles[:3] for p in a["paragraphs"])
    results = {}
    for name in args.models:
        config = EngineConfig(models={"m": ModelEntry(name, quant="none")}, max_kv_blocks=256)
        engine = LLMEngine(config, progress=False)
        worker = engine.worker("m")
        errors = {kind: defaultdict(list) for kind in KINDS}
        for layer in worker.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for kind in KINDS:
                    if hasattr(parent, kind):
                        setattr(parent, kind, Probe(getattr(parent, kind), errors[kind]))
        engine.score(worker.tokenizer.encode(text)[:args.tokens])
        results[name] = {kind: {b: sum(v) / len(v) for b, v in errors[kind].items()} for kind in KINDS}
        del engine, worker
    table = Table(title="Relative error of a projection's output, int8 weights, activations rounded to int8 "
                        "with one scale per ...")
    for col in ("model", "projection", "row", "block of 128", "block of 32", "row / 128"):
        table.add_column(col, justify="left" if col in ("model", "projection") else "right")
    for name, kinds in results.items():
        for kind, e in kinds.items():
            table.add_row(name, kind, *(f"{e[b]:.4f}" for b in BLOCKS), f"{e['row'] / e['128']:.1f}x")
    Console(width=140).print(table)
    write_results(args.out, {"machine": machine(), "tokens": args.tokens, "models": results})


if __name__ == "__main__":
    main()
