// Integer dot products of quantized matmuls (int8 weights per channel, int4 per group) for
// kernels/quant_matmul_cpu.py: float32 activations quantized inside to int8 per block, summed in
// int32 against the weights block by block, scaled once per block. Torch's own `_int_mm` has no
// fast kernel on AVX2 hosts and its packed int8/int4 ops convert every weight to float, so the
// weight read, which is a decode step's cost, is what these loops are shaped around. Built twice
// where the host has AVX-512 VNNI (SLUICE_VNNI): the same integer sums, so the same outputs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

// kernels/quant_matmul.py's quantize_rows to the bit, per block of B values (a multiple of 32
// dividing K): scale = max(|x|max, 1e-8) / 127 in float32, q = x / scale rounded half to even
// (the same division and rounding, 32 values at a time, and no index division per value: it runs
// once per matmul on one thread). `interleaved` (32 or 64, dividing B; 0: in order): each that
// many values stored as their even then their odd ones, the order a load of int4 weights unpacks
// in (low nibbles, high nibbles).
static inline __m256i round_to_int32(const float* r, __m256 s) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(r), s),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static void quantize_rows(const float* x, int64_t M, int64_t K, int64_t B, int interleaved, int8_t* q,
                          float* scales) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < K; b += B) {
            const float* r = x + m * K + b;
            __m256 vmax = _mm256_setzero_ps();
            for (int64_t k = 0; k < B; k += 8)
                vmax = _mm256_max_ps(vmax, _mm256_and_ps(magnitude, _mm256_loadu_ps(r + k)));
            const float s = std::max(hmax(vmax), 1e-8f) / 127.f;
            scales[(m * K + b) / B] = s;
            const __m256 vs = _mm256_set1_ps(s);
            int8_t* o = q + m * K + b;
            for (int64_t k = 0; k < B; k += 32) {
                // int32 -> int16 -> int8 packs work per 128-bit lane; the permute puts the values
                // back in order (|q| <= 127: nothing saturates).
                const __m256i ab = _mm256_packs_epi32(round_to_int32(r + k, vs), round_to_int32(r + k + 8, vs));
                const __m256i cd = _mm256_packs_epi32(round_to_int32(r + k + 16, vs), round_to_int32(r + k + 24, vs));
                _mm256_storeu_si256((__m256i*)(o + k),
                                    _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order));
            }
            if (interleaved) {
                int8_t in_order[64];
                for (int64_t k = 0; k < B; k += interleaved) {
                    std::memcpy(in_order, o + k, interleaved);
                    for (int j = 0; j < interleaved / 2; ++j) {
                        o[k + j] = in_order[2 * j];
                        o[k + interleaved / 2 + j] = in_order[2 * j + 1];
                    }
                }
            }
        }
}

// How far ahead of its loads a kernel asks for weights (_mm_prefetch, a cache line at a time).
// The hardware's prefetchers alone left a decode step's matmuls at 53-60% of the read bandwidth
// on the AVX2 EPYC; 2 KB ahead made them 1.15-1.26x faster at 1 row (benchmarks/gemm_bench.py
// --prefetch 0 2048, median steps; 512 and 1,024 bytes gained less in a trial). A prefetch past a
// buffer's end is a hint: it never faults. set_prefetch(0): the hardware's alone.
static int64_t prefetch_bytes = 2048;

int64_t set_prefetch(int64_t bytes) {        // returns the distance it replaces
    TORCH_CHECK(bytes >= 0, "set_prefetch: bytes must be >= 0");
    return std::exchange(prefetch_bytes, bytes);
}

// f(integral_constant<b>) for a block of b <= MB rows (or outputs): each size its own instance, so the
// accumulators stay in registers.
template <int MB, typename F>
static void block(int64_t b, F&& f) {
    if constexpr (MB > 1) {
        if (b < MB) return block<MB - 1>(b, f);
    }
    f(std::integral_constant<int, MB>{});
}

// int8: rows m0 .. m0 + MB of x against outputs n0 .. n1, each output's weights read once for
// the MB rows. Products by maddubs as llama.cpp does on AVX2: |w| the unsigned operand, x
// carrying w's sign; |x|, |w| <= 127 keep each pair's sum inside int16. Each block of B values
// sums in int32, then adds in float times its activation scale. C independent sums per row (B a
// multiple of 32 * C): VNNI's one instruction waits on the last one's result (several cycles), so
// one chain of them would bound a row's speed where AVX2's one-cycle adds do not. BT: the block
// known when compiling (128, the default; 0: B), so that a block's four loads unroll with no loop
// branch between them, which at one row with the weights in cache is most of the time's margin.
template <int MB, int C, int BT>
static void rows8(const int8_t* X, const float* XS, const int8_t* W, const float* WS, float* O,
                  int64_t m0, int64_t n0, int64_t n1, int64_t K, int64_t N, int64_t B_) {
    const int64_t B = BT ? BT : B_, G = K / B, ahead = prefetch_bytes;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; ++n) {
        const int8_t* w = W + n * K;
        __m256 acc[MB];
        for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
            __m256i part[C][MB];
            for (int c = 0; c < C; ++c)
                for (int i = 0; i < MB; ++i) part[c][i] = _mm256_setzero_si256();
            for (int64_t k0 = g * B; k0 < (g + 1) * B; k0 += 32 * C)
                for (int c = 0; c < C; ++c) {
                    const int64_t k = k0 + 32 * c;
                    if (ahead && (k & 63) == 0) _mm_prefetch((const char*)(w + k + ahead), _MM_HINT_T0);
                    const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + k));
                    const __m256i wa = _mm256_sign_epi8(wv, wv);
                    for (int i = 0; i < MB; ++i) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i*)(X + (m0 + i) * K + k));
                        part[c][i] = dot_u8s8(part[c][i], wa, _mm256_sign_epi8(xv, wv), ones);
                    }
                }
            for (int c = 1; c < C; ++c)
                for (int i = 0; i < MB; ++i) part[0][i] = _mm256_add_epi32(part[0][i], part[c][i]);
            for (int i = 0; i < MB; ++i)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[0][i]), _mm256_set1_ps(XS[(m0 + i) * G + g]), acc[i]);
        }
        for (int i = 0; i < MB; ++i) O[(m0 + i) * N + n] = hsum(acc[i]) * WS[n];
    }
}

static int64_t TILE_ROWS = 16;     // int8 matmuls over this many rows or more take tile8 (VNNI builds)

int64_t set_tile_rows(int64_t rows) {
    TORCH_CHECK(rows >= 1, "set_tile_rows: rows must be >= 1");
    return std::exchange(TILE_ROWS, rows);
}

#ifdef SLUICE_VNNI
// int8 prompts on VNNI: a register tile of MR rows by NR outputs, each weight load serving MR
// rows and each activation load NR outputs (rows8 loads an activation per product), with no sign
// instructions: VNNI multiplies unsigned by signed bytes, so the activations go in as x + 128
// (XU, unsigned) against w as it is, and each sum starts at -128 times w's sum (CORR: per output
// and block, in dpbusd's lanes), which takes the offset off exactly. The int32 lanes are then
// rows8's, and so is the float arithmetic after them: the same outputs to the bit. Blocks g0 .. g1
// of the inputs: ACC holds the float sums between such spans, [MR][NR] vectors.
template <int MR, int NR>
static void tile8(const uint8_t* XU, const float* XS, const int8_t* W, const __m256i* CORR, const float* WS,
                  float* O, __m256* ACC, int64_t m0, int64_t n0, int64_t t0, int64_t g0, int64_t g1, int64_t K,
                  int64_t N, int64_t B) {
    const int64_t G = K / B;
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = g0 ? ACC[i * NR + j] : _mm256_setzero_ps();
    for (int64_t g = g0; g < g1; ++g) {
        __m256i part[MR][NR];
        for (int j = 0; j < NR; ++j) {
            const __m256i corr = _mm256_load_si256(CORR + (n0 + j - t0) * G + g);
            for (int i = 0; i < MR; ++i) part[i][j] = corr;
        }
        for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
            __m256i wv[NR];
            for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_si256((const __m256i*)(W + (n0 + j) * K + k));
            for (int i = 0; i < MR; ++i) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(XU + (m0 + i) * K + k));
                for (int j = 0; j < NR; ++j) part[i][j] = _mm256_dpbusd_epi32(part[i][j], xv, wv[j]);
            }
        }
        for (int i = 0; i < MR; ++i) {
            const __m256 xs = _mm256_set1_ps(XS[(m0 + i) * G + g]);
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[i][j]), xs, acc[i][j]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            if (g1 < G) ACC[i * NR + j] = acc[i][j];
            else O[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) * WS[n0 + j];
        }
}

// Outputs t0 .. t1 of int8 x (M rows, as x + 128) times w: the tile's corrections first (one pass
// over its weights, which also brings them into the cache), then MR-row blocks over it, 2 KB of
// inputs at a time, so that a block's activations stay in L1 while every output reads them (whole
// 8,960-input rows, 35 KB for 4 rows, came from L2 instead: 0.55x the speed of 1,536-input ones).
static void tiles8(const uint8_t* XU, const float* XS, const int8_t* W, const float* WS, float* O,
                   int64_t M, int64_t t0, int64_t t1, int64_t K, int64_t N, int64_t B, __m256i* CORR,
                   __m256* ACC) {
    constexpr int MR = 4, NR = 3;
    const int64_t G = K / B, span = std::max<int64_t>(1, 2048 / B);
    const __m256i offset = _mm256_set1_epi8((char)0x80);
    for (int64_t n = t0; n < t1; ++n)
        for (int64_t g = 0; g < G; ++g) {
            __m256i sum = _mm256_setzero_si256();
            for (int64_t k = g * B; k < (g + 1) * B; k += 32)
                sum = _mm256_dpbusd_epi32(sum, offset, _mm256_loadu_si256((const __m256i*)(W + n * K + k)));
            CORR[(n - t0) * G + g] = _mm256_sub_epi32(_mm256_setzero_si256(), sum);
        }
    for (int64_t m0 = 0; m0 < M; m0 += MR)
        block<MR>(std::min<int64_t>(MR, M - m0), [&](auto mr) {
            for (int64_t g0 = 0; g0 < G; g0 += span)
                for (int64_t n0 = t0; n0 < t1; n0 += NR)
                    block<NR>(std::min<int64_t>(NR, t1 - n0), [&](auto nr) {
                        tile8<decltype(mr)::value, decltype(nr)::value>(XU, XS, W, CORR, WS, O, ACC + (n0 - t0) * MR,
                                                                      m0, n0, t0, g0, std::min(g0 + span, G), K, N, B);
                    });
        });
}
#endif

// int4 (engine/quantize.py's format: two per byte, the even k low; per group w = (q - zero) * scale):
// per group the int32 sum of q times x (q is unsigned: maddubs takes it as is), scaled by the
// group's scale times x's scale for the group, in float; the zeros come off once per output as
// zero * scale times the group's sum of x (XG, in x's scale). GT: the group known when compiling,
// as rows8's BT.
template <int MB, int GT>
static void rows4(const int8_t* X, const float* XS, const float* XG, const uint8_t* W, const float* S,
                  const float* ZS, float* O, int64_t m0, int64_t n0, int64_t n1, int64_t K, int64_t N,
                  int64_t group_) {
    const int64_t group = GT ? GT : group_, G = K / group, ahead = prefetch_bytes;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = W + n * (K / 2);
        __m256 acc[MB];
        for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
            __m256i part[MB], odd[MB];
            for (int i = 0; i < MB; ++i) part[i] = odd[i] = _mm256_setzero_si256();
            if (group % 64 == 0) {
                // 64 weights from one 32-byte load, no shuffle: the low nibbles are the evens and
                // the high the odds, as the activations are stored. The two products' int16 sums
                // add without overflow (|each| <= 2 * 15 * 127).
                for (int64_t k = g * group; k < (g + 1) * group; k += 64) {
                    if (ahead && (k & 127) == 0) _mm_prefetch((const char*)(w + k / 2 + ahead), _MM_HINT_T0);
                    const __m256i packed = _mm256_loadu_si256((const __m256i*)(w + k / 2));
                    const __m256i qe = _mm256_and_si256(low, packed);
                    const __m256i qo = _mm256_and_si256(low, _mm256_srli_epi16(packed, 4));
                    for (int i = 0; i < MB; ++i) {
                        const int8_t* xk = X + (m0 + i) * K + k;
                        const __m256i xe = _mm256_loadu_si256((const __m256i*)xk);
                        const __m256i xo = _mm256_loadu_si256((const __m256i*)(xk + 32));
#ifdef SLUICE_VNNI      // two chains, as rows8's
                        part[i] = _mm256_dpbusd_epi32(part[i], qe, xe);
                        odd[i] = _mm256_dpbusd_epi32(odd[i], qo, xo);
#else
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(qe, xe), _mm256_maddubs_epi16(qo, xo));
                        part[i] = _mm256_add_epi32(part[i], _mm256_madd_epi16(p, ones));
#endif
                    }
                }
            } else {
                for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                    if (ahead && (k & 127) == 0) _mm_prefetch((const char*)(w + k / 2 + ahead), _MM_HINT_T0);
                    const __m128i packed = _mm_loadu_si128((const __m128i*)(w + k / 2));
                    const __m256i q = _mm256_and_si256(low, _mm256_inserti128_si256(
                        _mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1));
                    for (int i = 0; i < MB; ++i) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i*)(X + (m0 + i) * K + k));
                        part[i] = dot_u8s8(part[i], q, xv, ones);
                    }
                }
            }
            for (int i = 0; i < MB; ++i) {
                const __m256 scale = _mm256_set1_ps(S[n * G + g] * XS[(m0 + i) * G + g]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(part[i], odd[i])), scale, acc[i]);
            }
        }
        for (int i = 0; i < MB; ++i) {
            // The zeros' dot product eight groups at a time rather than as a chain of scalar adds,
            // each waiting on the last (G of them per output: 70 for a 8,960-input layer).
            const float *zs = ZS + n * G, *xg = XG + (m0 + i) * G;
            __m256 z8 = _mm256_setzero_ps();
            int64_t g = 0;
            for (; g + 8 <= G; g += 8)
                z8 = _mm256_add_ps(z8, _mm256_mul_ps(_mm256_loadu_ps(zs + g), _mm256_loadu_ps(xg + g)));
            float zero = hsum(z8);
            for (; g < G; ++g) zero += zs[g] * xg[g];
            O[(m0 + i) * N + n] = hsum(acc[i]) - zero;
        }
    }
}

// How many outputs' weights (`row_bytes` each) a tile holds so that they stay in L2 while every
// block of rows passes over them: a prompt's rows then read the weights from memory once, not
// once per block. One tile for a decode step's few rows, as before.
static int64_t outputs_in_cache(int64_t row_bytes) {
    return std::max<int64_t>(1, (128 << 10) / row_bytes);
}

static void check(const torch::Tensor& x, const torch::Tensor& w, int64_t K, const char* name) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == K, name, ": x float32 [M, K]");
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), name, ": w contiguous [N, ...]");
}

// x float32 [M, K] times int8 w [N, K] with scales [N] -> float32 [M, N]; x's scales per block
// of B values, a multiple of 32 dividing K.
torch::Tensor int8_linear(const torch::Tensor& x_, const torch::Tensor& w, const torch::Tensor& scales_, int64_t B) {
    torch::Tensor x = x_.contiguous(), scales = scales_.contiguous();
    const int64_t K = w.size(1), N = w.size(0);
    check(x, w, K, "int8_linear");
    TORCH_CHECK(w.scalar_type() == torch::kInt8 && scales.scalar_type() == torch::kFloat && scales.numel() == N,
                "int8_linear: w int8 [N, K], scales float32 [N]");
    TORCH_CHECK(B > 0 && B % 32 == 0 && K % B == 0, "int8_linear: the block must be a multiple of 32 dividing K");
    const int64_t M = x.size(0);
    auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
    auto xs = torch::empty({M, K / B}, x.options());
    auto out = torch::empty({M, N}, x.options());
    quantize_rows(x.data_ptr<float>(), M, K, B, 0, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
    const int8_t* X = xq.data_ptr<int8_t>();
    const float *XS = xs.data_ptr<float>(), *WS = scales.data_ptr<float>();
    const int8_t* W = w.data_ptr<int8_t>();
    float* O = out.data_ptr<float>();
    const int64_t tile = outputs_in_cache(K);
#ifdef SLUICE_VNNI
    if (M >= TILE_ROWS) {
        uint8_t* XU = reinterpret_cast<uint8_t*>(xq.data_ptr<int8_t>());
        for (int64_t i = 0; i < M * K; ++i) XU[i] ^= 0x80;      // x + 128
        at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
            const int64_t outputs = std::min(tile, n1 - n0);
            std::vector<__m256i> corr(outputs * (K / B));
            std::vector<__m256> acc((outputs + 2) * 4);
            for (int64_t t0 = n0; t0 < n1; t0 += tile)
                tiles8(XU, XS, W, WS, O, M, t0, std::min(t0 + tile, n1), K, N, B, corr.data(), acc.data());
        });
        return out;
    }
#endif
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t t0 = n0; t0 < n1; t0 += tile)
            for (int64_t m0 = 0; m0 < M; m0 += 8)
                block<8>(std::min<int64_t>(8, M - m0), [&](auto mb) {
                    const int64_t t1 = std::min(t0 + tile, n1);
#ifdef SLUICE_VNNI
                    if (B == 128) return rows8<decltype(mb)::value, 2, 128>(X, XS, W, WS, O, m0, t0, t1, K, N, B);
                    if (B % 64 == 0) return rows8<decltype(mb)::value, 2, 0>(X, XS, W, WS, O, m0, t0, t1, K, N, B);
#endif
                    if (B == 128) return rows8<decltype(mb)::value, 1, 128>(X, XS, W, WS, O, m0, t0, t1, K, N, B);
                    rows8<decltype(mb)::value, 1, 0>(X, XS, W, WS, O, m0, t0, t1, K, N, B);
                });
    });
    return out;
}

// x float32 [M, K] times int4 w uint8 [N, K / 2] with scales and zero * scale [N, K / group]
// -> float32 [M, N]; group a multiple of 32.
torch::Tensor int4_linear(const torch::Tensor& x_, const torch::Tensor& w, const torch::Tensor& scales_,
                          const torch::Tensor& zero_scales_, int64_t group) {
    torch::Tensor x = x_.contiguous(), scales = scales_.contiguous(), zero_scales = zero_scales_.contiguous();
    const int64_t K = w.size(1) * 2, N = w.size(0);
    check(x, w, K, "int4_linear");
    TORCH_CHECK(group % 32 == 0 && K % group == 0, "int4_linear: the group must be a multiple of 32 dividing K");
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kFloat &&
                zero_scales.scalar_type() == torch::kFloat && scales.numel() == N * (K / group) &&
                zero_scales.numel() == N * (K / group),
                "int4_linear: w uint8 [N, K / 2], scales and zero_scales float32 [N, K / group]");
    const int64_t M = x.size(0), G = K / group;
    auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
    auto xs = torch::empty({M, G}, x.options());
    auto xg = torch::empty({M, G}, x.options());
    auto out = torch::empty({M, N}, x.options());
    quantize_rows(x.data_ptr<float>(), M, K, group, group % 64 ? 32 : 64, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
    const int8_t* X = xq.data_ptr<int8_t>();
    const float* XS = xs.data_ptr<float>();
    float* XG = xg.data_ptr<float>();      // each group's sum of x: its integer sum times its scale
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < G; ++g) {
            int32_t sum = 0;
            for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += X[m * K + k];
            XG[m * G + g] = float(sum) * XS[m * G + g];
        }
    const float *S = scales.data_ptr<float>(), *ZS = zero_scales.data_ptr<float>();
    const uint8_t* W = w.data_ptr<uint8_t>();
    float* O = out.data_ptr<float>();
    const int64_t tile = outputs_in_cache(K / 2);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t t0 = n0; t0 < n1; t0 += tile)
            for (int64_t m0 = 0; m0 < M; m0 += 4)
                block<4>(std::min<int64_t>(4, M - m0), [&](auto mb) {
                    const int64_t t1 = std::min(t0 + tile, n1);
                    constexpr int MB = decltype(mb)::value;
#ifdef SLUICE_VNNI      // VNNI's several rows ran 15% slower on the fixed group (a development run)
                    if (MB == 1 && group == 128)
#else
                    if (group == 128)
#endif
                        return rows4<MB, 128>(X, XS, XG, W, S, ZS, O, m0, t0, t1, K, N, group);
                    rows4<MB, 0>(X, XS, XG, W, S, ZS, O, m0, t0, t1, K, N, group);
                });
    });
    return out;
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.def("int8_linear(Tensor x, Tensor w, Tensor scales, int block) -> Tensor");
    m.def("int4_linear(Tensor x, Tensor w, Tensor scales, Tensor zero_scales, int group) -> Tensor");
    m.def("set_prefetch(int bytes) -> int", &set_prefetch);
    m.def("set_tile_rows(int rows) -> int", &set_tile_rows);
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
    m.impl("int8_linear", &int8_linear);
    m.impl("int4_linear", &int4_linear);
}
