"""Building the compiled CPU kernels (quant_matmul_cpu.py, layer_cpu.py): torch's C++ extension
loader, once per host (a C++ compiler and ninja; about a minute on 2 cores, cached under
~/.cache/torch_extensions). Their operators register in torch's dispatcher as torch.ops.sluice.*:
a few microseconds a call, and seen by the profiler under their names."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil

import torch

log = logging.getLogger(__name__)
# What every source starts with: the includes, and a float32 vector's horizontal sum and max.
PRELUDE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
"""


def vnni() -> bool:
    """Whether kernels that ask for it are built with AVX-512 VNNI's one-instruction byte dot
    products (`SLUICE_VNNI`): on a host that has them, unless SLUICE_CPU_VNNI=0. The integer
    sums are the same either way, so the outputs are too."""
    return torch.cpu._is_vnni_supported() and os.environ.get("SLUICE_CPU_VNNI", "1") != "0"


def build(name: str, source: str, what: str, use_vnni: bool = False) -> bool:
    """Compile and load PRELUDE + `source` as the extension `name` for AVX2 and FMA (and, with
    `use_vnni` where `vnni()`, AVX-512 VNNI with SLUICE_VNNI defined); False (logged, naming
    `what` falls back) where this host cannot."""
    if not torch.cpu._is_avx2_supported():
        return False
    try:
        from torch.utils.cpp_extension import load_inline
        if shutil.which("ninja") is None:     # the pinned ninja package's binary, off PATH in a bare venv
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        # at::parallel_for is OpenMP inlined into the module: without -fopenmp it runs on one
        # thread. No contraction: where a kernel is equal to its twin to the bit, a * b - c * d
        # must round as PyTorch's separate operators do (the kernels' FMAs are written out).
        # Named by the source's and flags' hash: processes of two versions of Sluice on one host
        # (a server kept running through an upgrade) would otherwise rebuild one build folder in
        # turn, and one could load the other's operators.
        flags = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
        if use_vnni and vnni():
            flags += ["-mavx512vnni", "-mavx512vl", "-DSLUICE_VNNI"]
        code = PRELUDE + source
        digest = hashlib.sha256((code + " ".join(flags)).encode()).hexdigest()[:12]
        load_inline(f"{name}_{digest}", [code], is_python_module=False, extra_cflags=flags, extra_ldflags=["-fopenmp"])
        return True
    except Exception as e:          # no compiler, no ninja: the PyTorch twins serve instead
        log.warning("the compiled CPU kernels %s could not be built (%s); %s", name, e, what)
        return False
