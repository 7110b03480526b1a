"""The compiled CPU matmul on GGUF's own blocks (csrc/gguf_linear.cpp), built once per host by
kernels/cpu_build.py; its twin is gguf_quant.py's `gguf_int8_matmul`."""
from __future__ import annotations

import functools

import torch

from kernels.cpu_build import CSRC, build


@functools.cache
def load():
    """torch.ops.sluice with `gguf_linear(x, parts, types, bias)`, or None where it cannot be built here."""
    ok = build("sluice_gguf_linear", [CSRC / "gguf_linear.cpp"], "the gguf precision runs on dequantized weights",
               use_vnni=True)
    return torch.ops.sluice if ok else None
