"""Integer dot products on the CPU, compiled for AVX2 hosts, where torch's own `_int_mm` has no
fast kernel (4-6 GFLOP/s measured on an AVX2 EPYC, benchmarks/gemm_bench.py) and its packed
int8/int4 ops convert every weight to float.

Each function takes float32 activations and returns float32 outputs: the activations are
quantized inside (one call per layer, where the Python twin makes eleven operator calls), one
scale per block of 128 values of a row (int8 weights; `act_block`) or per group (int4 weights),
summed in int32 against the weights block by block, and scaled. The reference twins are
kernels/quant_matmul.py's `int8_int8_matmul` with a block and `int4_int8_matmul`: the same
rounding and the same integer sums per block; the blocks' float sum runs in another order.

The C++ is kernels/csrc/quant_matmul.cpp, built once per host (kernels/cpu_build.py); `load()` is
None where that cannot be done, and the engine then keeps torch's ops.
"""
from __future__ import annotations

import functools

import torch

from kernels.cpu_build import CSRC, build


@functools.cache
def load():
    """The compiled operators (torch.ops.sluice: `int8_linear`, `int4_linear`, `set_prefetch`,
    `set_tile_rows`), or None where they cannot be built here."""
    ok = build("sluice_quant_linear", [CSRC / "quant_matmul.cpp"], "int8 and int4 run on torch's ops", use_vnni=True)
    return torch.ops.sluice if ok else None
