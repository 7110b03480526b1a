// GGUF's own quantized blocks times float32 activations: the `gguf` precision's matmul on the CPU.
//
// The weights stay as the file ships them (kernels/gguf_quant.py lays out the five types) and are
// decoded in registers, a block at a time, into 32-byte vectors of small integers. x is quantized
// to int8 per block of the type's activation block (llama.cpp's q8 activations): 32 values for
// the 32-weight types, whose one scale per block costs a float multiply-add per 32 weights
// whatever is done, and 256 for the K-quants, whose sub-blocks' 6- and 8-bit integer scales then
// multiply the integer dot products in int32 (one madd), leaving one float multiply-add per 256
// weights. Offsets (Q4_1's m, Q4_K's mins, Q5_0's -16 and Q6_K's -32) multiply x's integer sums
// per 16 values, precomputed once per call.
//
// The float sum over blocks runs per output in one fixed order, whatever the number of rows it
// is computed with, so a row's result is the same alone or in a batch (batch-invariant:
// speculation's verify pass and plain decoding pick the same greedy tokens).
// Twin: kernels/gguf_quant.py's `gguf_int8_matmul` (the same integer sums; float64 scaling).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "common.h"

// F16C (every AVX2 x86 has it) converts the blocks' float16 scales in one instruction.
#pragma GCC target("f16c")

namespace {

enum Type : int64_t { Q8_0 = 0, Q5_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4 };

// Weights and bytes per block, and how many activations share a scale.
struct Traits { int64_t block, bytes, act; };
constexpr Traits traits(int64_t t) {
    return t == Q8_0 ? Traits{32, 34, 32} : t == Q5_0 ? Traits{32, 22, 32} : t == Q4_1 ? Traits{32, 20, 32}
         : t == Q4_K ? Traits{256, 144, 256} : Traits{256, 210, 256};
}

static inline float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// 16 packed bytes -> 32 values: the low nibbles, then the high ones (GGML's order in a block of 32).
static inline __m256i nibbles16(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

// Bit j of a little-endian uint32 -> byte j: 0xFF where set, 0 where not.
static inline __m256i bits32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)v), which), bit);
    return _mm256_cmpeq_epi8(bytes, bit);
}

// u8 q times s8 x, summed per adjacent pair into int16 (|q| <= 127 signed or <= 63 unsigned: no
// pair saturates), then times int16 `scale` and summed per 4 bytes into int32 lanes. Q8_0's
// signed weights take the sign trick: |q| times x with q's sign.
template <bool SIGNED>
static inline __m256i dot(__m256i q, __m256i x, __m256i scale) {
    if constexpr (SIGNED) {
        x = _mm256_sign_epi8(x, q);
        q = _mm256_sign_epi8(q, q);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scale);
}

// Q4_K's 6-bit scale and min of sub-block j (GGML's packing of 12 bytes).
static inline void scale_min(const uint8_t* s, int j, int& sc, int& mn) {
    sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}

// Rows m0..m0+MB of x against outputs n0..n1. X int8 [M, K]; XS its scales per activation
// block; XI its integer sums per 16 values (what the offsets multiply).
template <int64_t T, int MB>
static void rows(const int8_t* X, const float* XS, const int32_t* XI, const uint8_t* W, float* O,
                 int64_t m0, int64_t n0, int64_t n1, int64_t K, int64_t N) {
    constexpr Traits tr = traits(T);
    const int64_t blocks = K / tr.block, row_bytes = blocks * tr.bytes;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = W + n * row_bytes;
        __m256 acc[MB];
        float off[MB];
        for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps(), off[i] = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* blk = w + b * tr.bytes;
            _mm_prefetch((const char*)(blk + 1024), _MM_HINT_T0);
            const int64_t k0 = b * tr.block;
            if constexpr (tr.block == 32) {
                const float d = f16(blk);
                float o = 0.f;                   // the offset per weight
                __m256i q;
                if constexpr (T == Q8_0) {
                    q = _mm256_loadu_si256((const __m256i*)(blk + 2));
                } else if constexpr (T == Q5_0) {
                    q = _mm256_or_si256(nibbles16(blk + 6), _mm256_and_si256(bits32(blk + 2), _mm256_set1_epi8(0x10)));
                    o = -16.f * d;
                } else {
                    q = nibbles16(blk + 4);
                    o = f16(blk + 2);
                }
                for (int i = 0; i < MB; ++i) {
                    const int64_t m = m0 + i;
                    const __m256i xv = _mm256_loadu_si256((const __m256i*)(X + m * K + k0));
                    const float sx = XS[(m * K + k0) / 32];
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot<T == Q8_0>(q, xv, ones)), _mm256_set1_ps(d * sx), acc[i]);
                    if constexpr (T != Q8_0) {
                        const int32_t* xi = XI + (m * K + k0) / 16;
                        off[i] += o * sx * (float)(xi[0] + xi[1]);
                    }
                }
            } else if constexpr (T == Q4_K) {
                const float d = f16(blk), dmin = f16(blk + 2);
                int sc[8], mn[8];
                for (int j = 0; j < 8; ++j) scale_min(blk + 4, j, sc[j], mn[j]);
                __m256i q[8];
                for (int j = 0; j < 8; j += 2) {
                    const __m256i packed = _mm256_loadu_si256((const __m256i*)(blk + 16 + 16 * j));
                    q[j] = _mm256_and_si256(packed, low);
                    q[j + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                }
                for (int i = 0; i < MB; ++i) {
                    const int64_t m = m0 + i;
                    const int8_t* x = X + m * K + k0;
                    const int32_t* xi = XI + (m * K + k0) / 16;
                    __m256i sum = _mm256_setzero_si256();
                    int mins = 0;
                    for (int j = 0; j < 8; ++j) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + 32 * j));
                        sum = _mm256_add_epi32(sum, dot<false>(q[j], xv, _mm256_set1_epi16((short)sc[j])));
                        mins += mn[j] * (xi[2 * j] + xi[2 * j + 1]);
                    }
                    const float sx = XS[(m * K + k0) / 256];
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * sx), acc[i]);
                    off[i] -= dmin * sx * (float)mins;
                }
            } else {                             // Q6_K: q - 32 as q 0..63 with an offset of -32
                const uint8_t *ql = blk, *qh = blk + 128;
                const int8_t* sc = (const int8_t*)(blk + 192);
                const float d = f16(blk + 208);
                __m256i q[8];
                for (int h = 0; h < 2; ++h) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32));
                    const __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + 32 * h));
                    const __m256i three = _mm256_set1_epi8(3);
                    const __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
                    const __m256i highs[4] = {_mm256_and_si256(hb, three),
                                              _mm256_and_si256(_mm256_srli_epi16(hb, 2), three),
                                              _mm256_and_si256(_mm256_srli_epi16(hb, 4), three),
                                              _mm256_and_si256(_mm256_srli_epi16(hb, 6), three)};
                    for (int j = 0; j < 4; ++j) q[4 * h + j] = _mm256_or_si256(lows[j], _mm256_slli_epi16(highs[j], 4));
                }
                for (int i = 0; i < MB; ++i) {
                    const int64_t m = m0 + i;
                    const int8_t* x = X + m * K + k0;
                    const int32_t* xi = XI + (m * K + k0) / 16;
                    __m256i sum = _mm256_setzero_si256();
                    int shift = 0;
                    for (int j = 0; j < 8; ++j) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + 32 * j));
                        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
                        sum = _mm256_add_epi32(sum, dot<false>(q[j], xv, scale));
                        shift += sc[2 * j] * xi[2 * j] + sc[2 * j + 1] * xi[2 * j + 1];
                    }
                    const float sx = XS[(m * K + k0) / 256];
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * sx), acc[i]);
                    off[i] -= 32.f * d * sx * (float)shift;
                }
            }
        }
        for (int i = 0; i < MB; ++i) O[(m0 + i) * N + n] = hsum(acc[i]) + off[i];
    }
}

template <int64_t T>
static void linear(const int8_t* X, const float* XS, const int32_t* XI, const uint8_t* W, float* O,
                   int64_t M, int64_t K, int64_t N) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) rows<T, 4>(X, XS, XI, W, O, m, n0, n1, K, N);
        for (; m < M; ++m) rows<T, 1>(X, XS, XI, W, O, m, n0, n1, K, N);
    });
}

// x per block of B values as int8 (scale = max(|x|max, 1e-8) / 127, x / scale rounded half to
// even: kernels/quant_matmul.py's quantize_rows), and the integer sum of every 16 values.
static void quantize(const float* x, int64_t MK, int64_t B, int8_t* q, float* xs, int32_t* xi) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t i = 0; i < MK; i += B) {
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t k = 0; k < B; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(magnitude, _mm256_loadu_ps(x + i + k)));
        const float s = std::max(hmax(vmax), 1e-8f) / 127.f;
        const __m256 vs = _mm256_set1_ps(s);
        xs[i / B] = s;
        for (int64_t k = 0; k < B; k += 16) {
            alignas(32) int32_t v[16];
            for (int h = 0; h < 16; h += 8)
                _mm256_store_si256((__m256i*)(v + h), _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_div_ps(_mm256_loadu_ps(x + i + k + h), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
            int32_t sum = 0;
            for (int j = 0; j < 16; ++j) q[i + k + j] = (int8_t)v[j], sum += v[j];
            xi[(i + k) / 16] = sum;
        }
    }
}

}  // namespace

// x float32 [M, K] times a GGUF tensor w uint8 [N, K / block * bytes] of `type` -> float32 [M, N].
torch::Tensor gguf_linear(const torch::Tensor& x_, const torch::Tensor& w, int64_t type) {
    TORCH_CHECK(type >= Q8_0 && type <= Q6_K, "gguf_linear: unknown type ", type);
    const torch::Tensor x = x_.contiguous();
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "gguf_linear: x float32 [M, K]");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    const Traits tr = traits(type);
    TORCH_CHECK(K % tr.block == 0, "gguf_linear: K = ", K, " is not a multiple of the type's block ", tr.block);
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() &&
                w.size(1) == K / tr.block * tr.bytes, "gguf_linear: w uint8 [N, ", K / tr.block * tr.bytes, "]");
    auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
    auto xs = torch::empty({M, K / tr.act}, x.options());
    auto xi = torch::empty({M, K / 16}, x.options().dtype(torch::kInt32));
    auto out = torch::empty({M, N}, x.options());
    quantize(x.data_ptr<float>(), M * K, tr.act, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xi.data_ptr<int32_t>());
    const int8_t* X = xq.data_ptr<int8_t>();
    const float* XS = xs.data_ptr<float>();
    const int32_t* XI = xi.data_ptr<int32_t>();
    const uint8_t* W = w.data_ptr<uint8_t>();
    float* O = out.data_ptr<float>();
    switch (type) {
        case Q8_0: linear<Q8_0>(X, XS, XI, W, O, M, K, N); break;
        case Q5_0: linear<Q5_0>(X, XS, XI, W, O, M, K, N); break;
        case Q4_1: linear<Q4_1>(X, XS, XI, W, O, M, K, N); break;
        case Q4_K: linear<Q4_K>(X, XS, XI, W, O, M, K, N); break;
        default: linear<Q6_K>(X, XS, XI, W, O, M, K, N);
    }
    return out;
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.def("gguf_linear(Tensor x, Tensor w, int type) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
    m.impl("gguf_linear", &gguf_linear);
}
