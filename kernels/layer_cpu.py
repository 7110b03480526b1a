"""A decoder layer's kernels other than its matmuls, compiled for the CPU: the residual add and
RMSNorm, rotary with the KV cache write, the SiLU product, and attention of decode tokens over
the paged cache. At batch 1 a step is mostly small operators, not arithmetic: the PyTorch
twins make five to a dozen calls each (attention rebuilds its slot map and mask, gathers the
cache, and pads), these make one, reading the block table where the cache is
(benchmarks/cpu_profile.py has the split).

The C++ is kernels/csrc/layer.cpp. Each has the signature of its reference twin
(kernels/norm_rope.py, attention.py, activation.py); tests/test_kernels.py compares them: rotary
and the cache write equal to the bit, the norm, the SiLU product and attention to float32
rounding (their sums and exp run in another order, exp by a polynomial). float32 only;
kernels/__init__.py runs the twins for other dtypes, where these cannot be built, and when
turned off (EngineConfig.cpu_kernels).
"""
from __future__ import annotations

import functools

import torch

from kernels.cpu_build import CSRC, build

KERNELS = ("add_rms_norm", "silu_and_mul", "rotary_store_kv", "paged_decode_attention")


@functools.cache
def load():
    """The compiled operators (torch.ops.sluice, the names in KERNELS), or None where they cannot
    be built here."""
    ok = build("sluice_layer", [CSRC / "layer.cpp"], "the layers run their PyTorch twins")
    return torch.ops.sluice if ok else None
