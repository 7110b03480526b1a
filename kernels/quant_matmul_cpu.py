"""Integer dot products on the CPU, compiled: int8 activations times int8 weights summed in
int32, for AVX2 hosts, where torch's own `_int_mm` has no fast kernel (4-6 GFLOP/s measured on
an AVX2 EPYC, benchmarks/gemm_bench.py) and its packed int8 op converts every weight to float.
The reference twin is kernels/quant_matmul.py's `int8_sums` (`torch._int_mm`): the sums are
integers, so the two agree exactly.

Built once per host with torch's C++ extension loader (a C++ compiler and ninja; about a minute
on 2 cores, cached under ~/.cache/torch_extensions); `load()` is None where that cannot be done,
and the engine then keeps torch's ops.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// Rows m0 .. m0 + MB of x against outputs n0 .. n1, NB outputs at a time sharing each load of
// x: MB and NB constants, so the MB * NB accumulators stay in registers. Products by maddubs as
// llama.cpp does on AVX2: |w| the unsigned operand, x carrying w's sign; |x|, |w| <= 127 keep
// each pair's sum inside int16.
template <int MB, int NB>
static void rows(const int8_t* X, const int8_t* W, int32_t* O, int64_t m0, int64_t n0, int64_t n1,
                 int64_t K, int64_t N) {
    const int64_t K32 = K / 32 * 32;
    const __m256i ones = _mm256_set1_epi16(1);
    int64_t n = n0;
    for (; n + NB <= n1; n += NB) {
        __m256i acc[MB][NB];
        for (int i = 0; i < MB; ++i)
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
        for (int64_t k = 0; k < K32; k += 32) {
            __m256i wv[NB], wa[NB];
            for (int j = 0; j < NB; ++j) {
                wv[j] = _mm256_loadu_si256((const __m256i*)(W + (n + j) * K + k));
                wa[j] = _mm256_sign_epi8(wv[j], wv[j]);
            }
            for (int i = 0; i < MB; ++i) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(X + (m0 + i) * K + k));
                for (int j = 0; j < NB; ++j) {
                    const __m256i p = _mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xv, wv[j]));
                    acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(p, ones));
                }
            }
        }
        for (int i = 0; i < MB; ++i)
            for (int j = 0; j < NB; ++j) {
                int32_t s = hsum(acc[i][j]);
                for (int64_t k = K32; k < K; ++k) s += int32_t(X[(m0 + i) * K + k]) * int32_t(W[(n + j) * K + k]);
                O[(m0 + i) * N + n + j] = s;
            }
    }
    if (n < n1) rows<MB, 1>(X, W, O, m0, n, n1, K, N);
}

// x [M, K] int8 times w [N, K] int8 (each output's weights contiguous, read once per 8 rows of
// x) -> [M, N] int32.
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.scalar_type() == torch::kInt8 && w.scalar_type() == torch::kInt8, "int8_mm takes int8");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_mm: x [M, K], w [N, K]");
    x = x.contiguous();
    w = w.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    auto out = torch::empty({M, N}, x.options().dtype(torch::kInt32));
    const int8_t* X = x.data_ptr<int8_t>();
    const int8_t* W = w.data_ptr<int8_t>();
    int32_t* O = out.data_ptr<int32_t>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            switch (std::min<int64_t>(8, M - m0)) {
                case 1: rows<1, 1>(X, W, O, m0, n0, n1, K, N); break;
                case 2: rows<2, 1>(X, W, O, m0, n0, n1, K, N); break;
                case 3: rows<3, 1>(X, W, O, m0, n0, n1, K, N); break;
                case 4: rows<4, 1>(X, W, O, m0, n0, n1, K, N); break;
                case 5: rows<5, 1>(X, W, O, m0, n0, n1, K, N); break;
                case 6: rows<6, 1>(X, W, O, m0, n0, n1, K, N); break;
                case 7: rows<7, 1>(X, W, O, m0, n0, n1, K, N); break;
                default: rows<8, 1>(X, W, O, m0, n0, n1, K, N);
            }
        }
    });
    return out;
}
"""


@functools.cache
def load():
    """The compiled module (its `int8_mm`), or None where it cannot be built here."""
    if not torch.cpu._is_avx2_supported():
        return None
    try:
        import shutil

        from torch.utils.cpp_extension import load_inline
        if shutil.which("ninja") is None:     # the pinned ninja package's binary, off PATH in a bare venv
            import os

            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        return load_inline("sluice_int8_mm", [SOURCE], functions=["int8_mm"], extra_cflags=["-O3", "-mavx2"])
    except Exception as e:          # no compiler, no ninja: torch's ops serve instead
        log.warning("the CPU int8 kernel could not be built (%s); int8 runs on torch's ops", e)
        return None


def int8_sums(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """kernels/quant_matmul.py's `int8_sums` on the compiled kernel (`load()` must not be None)."""
    return load().int8_mm(xq, w)
