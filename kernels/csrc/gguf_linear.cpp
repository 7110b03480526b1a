// GGUF's own quantized blocks times float32 activations: the `gguf` precision's matmul on the CPU.
//
// The weights stay as the file ships them (kernels/gguf_quant.py lays out the five types). Each
// block is decoded in registers into units of 32 small unsigned integers (Q8_0: signed) with a
// float scale and offset per half of 16, so one dot-product core serves every type:
//     w = scale * q + offset,  sum_k w_k x_k ~= sum_units sx * (scale * sum q xq + offset * sum xq)
// with x quantized to int8 per block of 32 (llama.cpp's q8 activations). The integer sums are
// exact; the float sum over units runs per output in one fixed order, whatever the number of
// rows it is computed with, so a row's result is the same alone or in a batch (batch-invariant:
// speculation's verify pass and plain decoding then pick the same greedy tokens).
// Twin: kernels/gguf_quant.py's `gguf_int8_matmul` (the same integer sums; float64 scaling).

#include <cstring>

// F16C (every AVX2 x86 has it) converts the blocks' float16 scales in one instruction.
#pragma GCC target("f16c")

namespace {

enum Type : int64_t { Q8_0 = 0, Q5_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4 };

struct Traits { int64_t block, bytes; };
constexpr Traits traits(int64_t t) {
    return t == Q8_0 ? Traits{32, 34} : t == Q5_0 ? Traits{32, 22} : t == Q4_1 ? Traits{32, 20}
         : t == Q4_K ? Traits{256, 144} : Traits{256, 210};
}

// One decoded unit of 32 weights; scale and offset per half of 16 (Q6_K's scale unit).
struct Unit {
    __m256i q;
    float scale[2], offset[2];
};

static inline float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline void set(Unit& u, __m256i q, float s0, float s1, float o0, float o1) {
    u.q = q;
    u.scale[0] = s0, u.scale[1] = s1, u.offset[0] = o0, u.offset[1] = o1;
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

// A block's units (1 for the 32-weight types, 8 for the K-quants' 256).
template <int64_t T>
static inline void decode(const uint8_t* b, Unit* u) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if constexpr (T == Q8_0) {
        const float d = f16(b);
        set(u[0], _mm256_loadu_si256((const __m256i*)(b + 2)), d, d, 0.f, 0.f);
    } else if constexpr (T == Q5_0) {      // q - 16 as q with an offset of -16 d
        const float d = f16(b);
        const __m256i high = _mm256_and_si256(bits32(b + 2), _mm256_set1_epi8(0x10));
        set(u[0], _mm256_or_si256(nibbles16(b + 6), high), d, d, -16.f * d, -16.f * d);
    } else if constexpr (T == Q4_1) {
        const float d = f16(b), m = f16(b + 2);
        set(u[0], nibbles16(b + 4), d, d, m, m);
    } else if constexpr (T == Q4_K) {
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t* s = b + 4;
        for (int j = 0; j < 8; ++j) {
            const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
            const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            const float scale = d * (float)sc, offset = -(dmin * (float)mn);
            const __m256i packed = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * (j / 2)));
            const __m256i q = j % 2 ? _mm256_and_si256(_mm256_srli_epi16(packed, 4), low)
                                    : _mm256_and_si256(packed, low);
            set(u[j], q, scale, scale, offset, offset);
        }
    } else {                              // Q6_K: q - 32 as q with an offset of -32 scale
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t* sc = (const int8_t*)(b + 192);
        const float d = f16(b + 208);
        const __m256i two = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; ++h) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + 32 * h));
            const __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                                     _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                     _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
            for (int j = 0; j < 4; ++j) {
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), two);
                const __m256i q = _mm256_or_si256(lows[j], _mm256_slli_epi16(high, 4));
                const int g = 4 * h + j;
                const float s0 = d * (float)sc[2 * g], s1 = d * (float)sc[2 * g + 1];
                set(u[g], q, s0, s1, -32.f * s0, -32.f * s1);
            }
        }
    }
}

// sum q * x per 4 bytes, as int32 lanes: lanes 0-3 the unit's first 16 weights, 4-7 its last.
template <bool SIGNED>
static inline __m256i dot(__m256i q, __m256i x) {
    if constexpr (SIGNED) {
        x = _mm256_sign_epi8(x, q);
        q = _mm256_sign_epi8(q, q);
    }
#ifdef SLUICE_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
    // |q| <= 127 with signed weights, <= 63 unsigned: a pair's int16 sum never saturates.
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

// Rows m0..m0+MB of x against outputs n0..n1. X int8 [M, K]; XS the scales per 32; XF per 16
// values the scale times the integer sum (what an offset multiplies).
template <int64_t T, int MB>
static void rows(const int8_t* X, const float* XS, const float* XF, const uint8_t* W, float* O,
                 int64_t m0, int64_t n0, int64_t n1, int64_t K, int64_t N) {
    constexpr Traits tr = traits(T);
    constexpr int U = tr.block / 32;
    const int64_t blocks = K / tr.block, row_bytes = blocks * tr.bytes;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = W + n * row_bytes;
        __m256 acc[MB];
        float off[MB];
        for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps(), off[i] = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
            _mm_prefetch((const char*)(w + (b + 8) * tr.bytes), _MM_HINT_T0);
            Unit u[U];
            decode<T>(w + b * tr.bytes, u);
            for (int i = 0; i < MB; ++i) {
                const int64_t m = m0 + i, k0 = b * tr.block;
                for (int j = 0; j < U; ++j) {
                    const int64_t k = k0 + 32 * j;
                    const __m256i xv = _mm256_loadu_si256((const __m256i*)(X + m * K + k));
                    const float sx = XS[(m * K + k) / 32];
                    const __m256 scale = _mm256_set_m128(_mm_set1_ps(u[j].scale[1] * sx),
                                                         _mm_set1_ps(u[j].scale[0] * sx));
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot<T == Q8_0>(u[j].q, xv)), scale, acc[i]);
                    if constexpr (T != Q8_0) {
                        const float* xf = XF + (m * K + k) / 16;
                        off[i] += u[j].offset[0] * xf[0] + u[j].offset[1] * xf[1];
                    }
                }
            }
        }
        for (int i = 0; i < MB; ++i) O[(m0 + i) * N + n] = hsum(acc[i]) + off[i];
    }
}

template <int64_t T>
static void linear(const int8_t* X, const float* XS, const float* XF, const uint8_t* W, float* O,
                   int64_t M, int64_t K, int64_t N) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) rows<T, 4>(X, XS, XF, W, O, m, n0, n1, K, N);
        for (; m < M; ++m) rows<T, 1>(X, XS, XF, W, O, m, n0, n1, K, N);
    });
}

// x per block of 32 as int8 (scale = max(|x|max, 1e-8) / 127, x / scale rounded half to even:
// kernels/quant_matmul.py's quantize_rows), and per 16 values their scale times their sum.
static void quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* xs, float* xf) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t i = 0; i < M * K; i += 32) {
        __m256 vmax = _mm256_setzero_ps();
        for (int k = 0; k < 32; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(magnitude, _mm256_loadu_ps(x + i + k)));
        const float s = std::max(hmax(vmax), 1e-8f) / 127.f;
        const __m256 vs = _mm256_set1_ps(s);
        int sums[2] = {0, 0};
        for (int k = 0; k < 32; k += 8) {
            const __m256i r = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + k), vs),
                                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            alignas(32) int32_t v[8];
            _mm256_store_si256((__m256i*)v, r);
            for (int j = 0; j < 8; ++j) q[i + k + j] = (int8_t)v[j], sums[k / 16] += v[j];
        }
        xs[i / 32] = s;
        xf[i / 16] = s * (float)sums[0];
        xf[i / 16 + 1] = s * (float)sums[1];
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
    auto xs = torch::empty({M, K / 32}, x.options()), xf = torch::empty({M, K / 16}, x.options());
    auto out = torch::empty({M, N}, x.options());
    quantize(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xf.data_ptr<float>());
    const int8_t* X = xq.data_ptr<int8_t>();
    const float *XS = xs.data_ptr<float>(), *XF = xf.data_ptr<float>();
    const uint8_t* W = w.data_ptr<uint8_t>();
    float* O = out.data_ptr<float>();
    switch (type) {
        case Q8_0: linear<Q8_0>(X, XS, XF, W, O, M, K, N); break;
        case Q5_0: linear<Q5_0>(X, XS, XF, W, O, M, K, N); break;
        case Q4_1: linear<Q4_1>(X, XS, XF, W, O, M, K, N); break;
        case Q4_K: linear<Q4_K>(X, XS, XF, W, O, M, K, N); break;
        default: linear<Q6_K>(X, XS, XF, W, O, M, K, N);
    }
    return out;
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.def("gguf_linear(Tensor x, Tensor w, int type) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
    m.impl("gguf_linear", &gguf_linear);
}
