"""A GGUF with a real model's metadata, tokenizer and tensor layout but random weights, rebuilt
from its header alone: for benchmarking on a machine the weights cannot be copied to (the
device machine takes 64 MiB; a model's header is about 6 MB, its weights 0.5-1.1 GB).

    python benchmarks/random_gguf.py header <cache>/gguf/qwen2.5-coder-0.5b.gguf .whl/q05.header
    python benchmarks/random_gguf.py fill .whl/q05.header /tmp/q05.gguf

`header` keeps the bytes before the tensor data and a JSON list of the tensors (name, type,
offset, bytes). `fill` writes those bytes back and each tensor as random blocks of its type,
with every block's float16 scales set to small normal values (random bytes there would make
infinities and NaNs; float32 tensors, the norms and biases, are near 1), so both engines compute
on ordinary numbers and read exactly what they would read from the real file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# Byte offsets of the float16 scales in one block of each quantized type llama.cpp's Q4_K_M and
# Q4_1 files use (ggml-common.h's block layouts), with the value written there.
SCALES = {"Q4_0": {0: 0.01}, "Q4_1": {0: 0.01, 2: -0.075}, "Q5_0": {0: 0.01}, "Q5_1": {0: 0.01, 2: -0.155},
          "Q8_0": {0: 0.001}, "Q4_K": {0: 0.01, 2: 0.005}, "Q5_K": {0: 0.01, 2: 0.005}, "Q6_K": {208: 0.01}}


def header(src: Path, dst: Path) -> None:
    from gguf import GGUFReader
    reader = GGUFReader(src)
    tensors = [{"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset) - reader.data_offset,
                "bytes": int(t.n_bytes)} for t in reader.tensors]
    with open(src, "rb") as f:
        dst.write_bytes(f.read(reader.data_offset))
    dst.with_suffix(".json").write_text(json.dumps({"data_offset": reader.data_offset, "tensors": tensors}))
    print(f"{dst}: {reader.data_offset / 1e6:.1f} MB of header, {len(tensors)} tensors")


def fill(head: Path, dst: Path, seed: int = 0) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    layout = json.loads(head.with_suffix(".json").read_text())
    rng = np.random.default_rng(seed)
    with open(dst, "wb") as f:
        f.write(head.read_bytes())
        for t in sorted(layout["tensors"], key=lambda t: t["offset"]):
            f.seek(layout["data_offset"] + t["offset"])
            if t["type"] == "F32":
                data = rng.normal(1.0, 0.1, t["bytes"] // 4).astype(np.float32).tobytes()
            elif t["type"] in SCALES:
                _, block = GGML_QUANT_SIZES[GGMLQuantizationType[t["type"]]]
                blocks = rng.integers(0, 256, (t["bytes"] // block, block), dtype=np.uint8)
                for at, value in SCALES[t["type"]].items():
                    blocks[:, at:at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
                data = blocks.tobytes()
            else:
                sys.exit(f"random_gguf: tensor {t['name']} has type {t['type']}, which this script cannot fill")
            f.write(data)
    print(f"{dst}: {dst.stat().st_size / 1e6:.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["header", "fill"])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    args = ap.parse_args()
    (header if args.command == "header" else fill)(args.src, args.dst)


if __name__ == "__main__":
    main()
