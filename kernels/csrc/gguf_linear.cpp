// GGUF's own quantized blocks times float32 activations: the `gguf` precision's matmul on the CPU.
//
// The weights stay as the file ships them (kernels/gguf_quant.py lays out the five types). x is
// quantized to int8 per block of the type's activation block (llama.cpp's q8 activations): 32
// values for the 32-weight types, 256 for the K-quants, with the integer sum of every unit (the
// values one weight scale covers: 16 for Q6_K, else 32) for the offsets to multiply.
//
// A weight block is decoded once per call and tile of rows, into 32-byte vectors of small
// integers and vectors of its sub-block scales, and every row of the tile runs against it: the
// integer dot products (u8 times s8 summed in pairs, then times the sub-block's int16 scale and
// summed in int32), the offsets on x's unit sums in the same int32 (Q6_K's -32) or with one madd
// of their own (Q4_K's mins), and one float step per block. A K-quant's step works on each row's
// whole integer sum, 8 rows in the lanes of one vector: per row and block it took two conversions,
// two multiply-adds, their scalar scales and a register for the row's lanes, and at 8 rows a
// trial without them ran 1.4x faster. The K-quants decode a half block (four sub-blocks and their scales)
// at a time, so the half block, a row's partial sum and the temporaries fit AVX2's 16 vector
// registers. Four output rows take their turns on a block of a tile of rows of x, which stays in
// L1 for them; the tile's rows of x stay in L2.
//
// The float sum over blocks runs per output in one fixed order, whatever the number of rows or
// the tile they are computed in (the integer sums are exact in any order), so a row's result is
// the same alone or in a batch (batch-invariant: speculation's verify pass and plain decoding
// pick the same greedy tokens).
// Twin: kernels/gguf_quant.py's `gguf_int8_matmul` (the same integer sums; float64 scaling).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"

// F16C (every AVX2 x86 has it) converts the blocks' float16 scales in one instruction.
#pragma GCC target("f16c")

namespace {

// Repacked at load (kernels/gguf_quant.py): Q5_0x4 and Q8_0x4, four blocks interleaved (`group_q5_0`,
// `group_q8_0`); Q4_Kx, Q4_K with its scales and mins a byte each and its units paired (`repack_q4_k`);
// Q6_Kx, Q6_K with its units of 16 in quads and a half block in three runs (`repack_q6_k`).
enum Type : int64_t { Q8_0 = 0, Q5_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4, Q5_0x4 = 5, Q4_Kx = 6, Q8_0x4 = 7, Q6_Kx = 8 };

// The order x is quantized in: as it comes, the x4 layouts' interleaved one, Q4_Kx's pairs or Q6_Kx's quads.
enum Order : int { NATURAL, X4, PAIRS, QUADS };
// Weights and bytes per block, activations per int8 scale, per unit sum of x, and x's order.
struct Traits { int64_t block, bytes, act, unit; Order order = NATURAL; };
constexpr Traits traits(int64_t t) {
    return t == Q8_0 ? Traits{32, 34, 32, 32} : t == Q5_0 ? Traits{32, 22, 32, 32} : t == Q4_1 ? Traits{32, 20, 32, 32}
         : t == Q4_K ? Traits{256, 144, 256, 32} : t == Q4_Kx ? Traits{256, 148, 256, 32, PAIRS}
         : t == Q6_K ? Traits{256, 210, 256, 16} : t == Q6_Kx ? Traits{256, 210, 256, 16, QUADS}
         : t == Q5_0x4 ? Traits{128, 88, 32, 32, X4} : Traits{128, 136, 32, 32, X4};
}

constexpr int TILE = 32;        // rows of x per tile: a block's share of them is 8 KiB (K-quants)
constexpr int GROUP = 4;        // output rows that take turns on a tile's block
constexpr int DECODE = 8;       // up to how many rows of x take the outputs one at a time
constexpr int PREFETCH = 2048;  // bytes of weights ahead of the block being read

// x quantized: `q` int8 [M, K], `scale` per `act` values, `sum` int16 per `unit` values. With steps
// (a K-quant's `act` of 256 values), a step per 32 of them, `mult` (1..steps, int16 per 32 values)
// times `scale`, and `sum`s counted in those steps (a unit's integer sum times its mult).
struct Act {
    const int8_t* q;
    const float* scale;
    const int16_t* sum;
    const int16_t* mult;    // nullptr: one step, `scale`
    int64_t K;
};
constexpr int64_t MAX_STEPS = 8;    // keeps every int16 product below 2**15 (kernels/gguf_quant.py)

// Where a part's outputs go: columns of a row-major [M, ld] result, plus the layer's bias there.
struct Out {
    float* o;
    int64_t ld;
    const float* bias;      // or nullptr

    void put(int64_t r, int64_t n, float v) const { o[r * ld + n] = bias ? v + bias[n] : v; }
};

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

static inline __m256i load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// acc + u8 q times s8 x, summed per adjacent pair into int16 (q <= 63: no pair saturates), then
// times the int16 `scale` and summed per pair into int32 lanes.
static inline __m256i dot(__m256i acc, __m256i q, const int8_t* x, __m256i scale) {
    return dot_s16(acc, _mm256_maddubs_epi16(q, load(x)), scale);
}

// Q4_Kx's half block, two pairs of units: vector 2 i + j holds weights 16 j .. 16 j + 15 of
// both units of pair i (the first's in its low 128 bits), x in the same order (Order PAIRS).
// The two vectors of a pair add up in int16 (at most 2 * 2 * 15 * 127 = 7620) before their
// pair's scales (s01, s23: the first unit's in the low half) multiply: a multiply per 64
// weights fewer than `dot4`. Q6_Kx's the same with quads of units of 16 (vector 2 i + j holds
// weights 8 j .. 8 j + 7 of each unit of quad i; at most 2 * 2 * 63 * 127 = 32004), its
// scales s01 and s23 the two quads'.
static inline __m256i dot_pairs(__m256i q0, __m256i q1, __m256i q2, __m256i q3, const int8_t* x, __m256i s01,
                                __m256i s23) {
    const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(q0, load(x)), _mm256_maddubs_epi16(q1, load(x + 32)));
    const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(q2, load(x + 64)), _mm256_maddubs_epi16(q3, load(x + 96)));
    return dot_s16(_mm256_madd_epi16(a, s01), b, s23);
}

// A K-quant's half block, four units of 32 with a scale each, against x's 128 values there.
static inline __m256i dot4(__m256i q0, __m256i q1, __m256i q2, __m256i q3, const int8_t* x,
                           __m256i s0, __m256i s1, __m256i s2, __m256i s3) {
    const __m256i zero = _mm256_setzero_si256();
    return _mm256_add_epi32(dot(dot(zero, q0, x, s0), q1, x + 32, s1), dot(dot(zero, q2, x + 64, s2), q3, x + 96, s3));
}

// The K-quants' outputs are per row, not per lane: a block's integer sums settle, then one float
// step serves 8 rows, row 8 g + j in lane j of acc[g] (`settle_rows`).
constexpr bool rows_in_lanes(int64_t t) { return t == Q4_K || t == Q4_Kx || t == Q6_K || t == Q6_Kx; }
constexpr bool has_mins(int64_t t) { return t == Q4_K || t == Q4_Kx; }

// Four rows of four int32 lanes (0 beyond n) -> each row's sum in lane j: exact.
static inline __m128i row_sums4(const __m128i* v, int n) {
    const __m128i zero = _mm_setzero_si128();
    const auto at = [&](int j) { return j < n ? v[j] : zero; };
    return _mm_hadd_epi32(_mm_hadd_epi32(at(0), at(1)), _mm_hadd_epi32(at(2), at(3)));
}

// Eight rows of four int32 lanes (0 beyond n; at least 4 rows): row j's sum in lane j.
static inline __m256i row_sums8(const __m128i* v, int n) {
    const __m128i zero = _mm_setzero_si128();
    const auto pair = [&](int j) { return _mm256_set_m128i(j + 4 < n ? v[j + 4] : zero, v[j]); };
    return _mm256_hadd_epi32(_mm256_hadd_epi32(pair(0), pair(1)), _mm256_hadd_epi32(pair(2), pair(3)));
}

// The same of eight rows of eight lanes.
static inline __m256i row_sums8(const __m256i* v, int n) {
    const __m256i zero = _mm256_setzero_si256();
    const auto at = [&](int j) { return j < n ? v[j] : zero; };
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(at(0), at(1)), _mm256_hadd_epi32(at(2), at(3)));
    const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(at(4), at(5)), _mm256_hadd_epi32(at(6), at(7)));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

// acc += lanes * s, the float step every block ends with.
static inline __m256 scaled(__m256 acc, __m256i lanes, float s) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(s), acc);
}

// Byte shuffles that broadcast one int16 of a 128-bit vector (both halves of a 256-bit one) to
// all its lanes: sub-block j's scale.
alignas(32) constexpr int8_t WORD[8][32] = {
#define W(j) {2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
               2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1,     \
               2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1,     \
               2 * j, 2 * j + 1}
    W(0), W(1), W(2), W(3), W(4), W(5), W(6), W(7)
#undef W
};
// The scales of units 2 i and 2 i + 1 (Q4_Kx's pair i; Q6_K's sub-block i of a half block) from
// eight int16 scales in both halves of a vector: the first in the low half's lanes, the second
// in the high half's.
alignas(32) constexpr int8_t PAIRED[4][32] = {
#define P(i) {4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, \
               4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3,     \
               4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3}
    P(0), P(1), P(2), P(3)
#undef P
};
// Q6_Kx's quad i of a half block from its eight int16 scales in both halves of a vector: units
// 4 i and 4 i + 1 in the low half's lanes (four each), 4 i + 2 and 4 i + 3 in the high half's.
alignas(32) constexpr int8_t QUAD[2][32] = {
#define U(u) 2 * (u), 2 * (u) + 1, 2 * (u), 2 * (u) + 1, 2 * (u), 2 * (u) + 1, 2 * (u), 2 * (u) + 1
    {U(0), U(1), U(2), U(3)}, {U(4), U(5), U(6), U(7)}
#undef U
};
// Q4_K's twelve bytes of 6-bit scales and mins (GGML's packing) -> sub-block j's scale in
// bytes j, its min in bytes 8 + j.
static inline __m128i scales_mins(const uint8_t* s) {
    uint32_t a, b, c;
    std::memcpy(&a, s, 4);
    std::memcpy(&b, s + 4, 4);
    std::memcpy(&c, s + 8, 4);
    const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
    return _mm_setr_epi32(a & six, (c & four) | ((a >> 6) & two) << 4,
                          b & six, ((c >> 4) & four) | ((b >> 6) & two) << 4);
}

// Q5_0x4's fifth bits: byte p of its 16 holds those of weight p of its four vectors in bits 4 to 7
// and of weight 16 + p in bits 0 to 3 (vector j's in bit 4 + j, j). Returned as a vector whose
// byte p holds weight p's bits of all four vectors in bits 4 to 7 (the high half: weight 16 + p's):
// vector j's then take one shift by j, not a variable shift per lane.
static inline __m256i x4_fifth(const uint8_t* blk) {
    const __m128i f = _mm_loadu_si128((const __m128i*)(blk + 8));
    return _mm256_set_m128i(_mm_slli_epi16(f, 4), f);        // what crosses bytes lands outside bits 4 to 7
}

// Q5_0x4's vector j of 32 weights as stored, q 0..31 (the weight is q - 16): two vectors' low
// four bits in each 32-byte run, the fifth from `x4_fifth`.
static inline __m256i x4_vector(const uint8_t* blk, __m256i fifth, int j) {
    const __m256i v = load(blk + 24 + 32 * (j / 2)), sixteen = _mm256_set1_epi8(16);
    return _mm256_or_si256(_mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F)),
                           _mm256_and_si256(j ? _mm256_srli_epi16(fifth, j) : fifth, sixteen));
}

// A block of a type with units of 32: its 32 integers, as signed bytes (Q8_0, Q5_0: multiplied as
// |q| times x with q's sign) or unsigned (Q4_1), and its scale d.
template <int64_t T>
static inline __m256i unit(const uint8_t* blk, float& d) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    d = f16(blk);
    if constexpr (T == Q8_0) return load(blk + 2);
    if constexpr (T == Q5_0)
        return _mm256_sub_epi8(_mm256_or_si256(nibbles16(blk + 6), _mm256_and_si256(bits32(blk + 2), sixteen)), sixteen);
    return nibbles16(blk + 4);
}

// A K-quant block's integer sums for rows [0, R) of the tile at x: the lanes of part[r] add up
// to row r's sum of unit scale times q times x (Q6_K's -32 times x's unit sums settled in them),
// those of mins[r] to its mins times x's unit sums (Q4_K; Q6_K has none). Returns the block's
// float scales d and dmin. A half block (128 weights) at a time: each row's four unit dot
// products, the halves adding up in part[r].
template <int64_t T, int ROWS = 0>
static inline std::pair<float, float> kquant(const uint8_t* blk, const Act& x, int64_t b, int rows, __m256i* part,
                                             __m128i* mins) {
    const int R = ROWS ? ROWS : rows;
    const int64_t K = x.K, k0 = b * 256, sums_per_row = K / traits(T).unit, mults_per_row = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F);
    constexpr int NS = T == Q4_K || T == Q6_K ? 4 : 2;     // scale vectors per half block (a unit's, a pair's)
    // Half block h's weights q0..q3 against each row's x there, times their unit scales: shuffled
    // (`control(i)`, scale vector i) from `base`, the block's int16 scales, once for the tile; or
    // with steps from row r's `stepped[r]`, those times x's step multiples. The halves add up in
    // part[r], the second through `finish`.
    const auto half = [&](int h, __m256i q0, __m256i q1, __m256i q2, __m256i q3, __m256i base, const __m256i* stepped,
                          auto&& control, auto&& finish) {
        const auto add = [&](int r, const __m256i* s) {
            const int8_t* xr = x.q + r * K + k0 + 128 * h;
            __m256i sum;
            if constexpr (NS == 2) sum = dot_pairs(q0, q1, q2, q3, xr, s[0], s[1]);
            else sum = dot4(q0, q1, q2, q3, xr, s[0], s[1], s[2], s[3]);
            part[r] = h == 0 ? sum : finish(r, _mm256_add_epi32(part[r], sum));
        };
        __m256i s[NS];
        if (x.mult) {
            for (int r = 0; r < R; ++r) {
                for (int i = 0; i < NS; ++i) s[i] = _mm256_shuffle_epi8(stepped[r], control(i));
                add(r, s);
            }
        } else {
            for (int i = 0; i < NS; ++i) s[i] = _mm256_shuffle_epi8(base, control(i));
            for (int r = 0; r < R; ++r) add(r, s);
        }
    };
    if constexpr (T == Q4_K || T == Q4_Kx) {
        // d and dmin, then the scales and mins: a byte each (Q4_Kx) or GGML's twelve bytes of them.
        int32_t both;
        std::memcpy(&both, blk, 4);
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
        const float d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
        const __m128i sm = T == Q4_K ? scales_mins(blk + 4) : _mm_loadu_si128((const __m128i*)(blk + 4));
        const uint8_t* qs = blk + (T == Q4_K ? 16 : 20);

        // The eight scales as int16 in both halves (each half's shuffles pick from its own), the mins in one.
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        const __m128i m = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
        for (int r = 0; r < R; ++r)
            mins[r] = _mm_madd_epi16(m, _mm_loadu_si128((const __m128i*)(x.sum + r * sums_per_row + k0 / 32)));
        // With steps, each row's sub-block scales times x's step multiples there (at most 63 * 8),
        // once a block; the unit scales then take their shuffles per row, not once for the tile.
        __m256i row[ROWS ? ROWS : TILE];
        if (x.mult)
            for (int r = 0; r < R; ++r)
                row[r] = _mm256_mullo_epi16(scales, _mm256_broadcastsi128_si256(_mm_loadu_si128(
                                                (const __m128i*)(x.mult + r * mults_per_row + k0 / 32))));
        for (int h = 0; h < 2; ++h) {
            const __m256i p0 = load(qs + 64 * h), p1 = load(qs + 32 + 64 * h);
            const __m256i q0 = _mm256_and_si256(p0, low), q1 = _mm256_and_si256(_mm256_srli_epi16(p0, 4), low);
            const __m256i q2 = _mm256_and_si256(p1, low), q3 = _mm256_and_si256(_mm256_srli_epi16(p1, 4), low);
            half(h, q0, q1, q2, q3, scales, row,
                 [h](int i) { return load(T == Q4_K ? WORD[4 * h + i] : PAIRED[2 * h + i]); },
                 [](int, __m256i total) { return total; });
        }
        return {d, dmin};
    } else {                                        // Q6_K(x): q - 32 as q 0..63, and -32 times x's unit sums
        const uint8_t* sc = blk + 192;
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
        // Half block h's eight unit scales as int16 in both halves of a vector: sub-block i's two
        // (Q6_Kx: quad i's four) are then one in-lane shuffle away (PAIRED[i], QUAD[i]), not a
        // lane-crossing permute and a shuffle.
        const auto eight = [&](int h) {
            return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(sc + 8 * h))));
        };
        // With steps, each row's unit scales times x's step multiples there (at most 128 * 8), once
        // a block: a multiple per 32 values, for both its units.
        __m256i row[2][ROWS ? ROWS : TILE];
        if (x.mult)
            for (int h = 0; h < 2; ++h) {
                const __m256i units = eight(h);
                for (int r = 0; r < R; ++r) {
                    const __m128i m = _mm_loadl_epi64((const __m128i*)(x.mult + r * mults_per_row + k0 / 32 + 4 * h));
                    row[h][r] = _mm256_mullo_epi16(units, _mm256_broadcastsi128_si256(_mm_unpacklo_epi16(m, m)));
                }
            }
        for (int h = 0; h < 2; ++h) {
            __m256i q0, q1, q2, q3;
            if constexpr (T == Q6_K) {
                // Low nibbles in two runs, vector j's two high bits in bits 2 j and 2 j + 1 of a third,
                // shifted to bits 4 and 5 (16-bit shifts: what crosses into the next byte falls
                // outside the mask).
                const __m256i l0 = load(blk + 64 * h), l1 = load(blk + 64 * h + 32), hb = load(blk + 128 + 32 * h);
                const __m256i top = _mm256_set1_epi8(0x30);
                q0 = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
                q1 = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
                q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, top));
                q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                     _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
            } else {
                // Three runs: vector i's six bits in the low bits of run i, vector 3's two at a time
                // in their top two: three shifts a half, Q6_K's layout five.
                const __m256i r0 = load(blk + 96 * h), r1 = load(blk + 96 * h + 32), r2 = load(blk + 96 * h + 64);
                const __m256i six = _mm256_set1_epi8(0x3F);
                q0 = _mm256_and_si256(r0, six), q1 = _mm256_and_si256(r1, six), q2 = _mm256_and_si256(r2, six);
                q3 = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(r0, 6), _mm256_set1_epi8(0x03)),
                                                     _mm256_and_si256(_mm256_srli_epi16(r1, 4), _mm256_set1_epi8(0x0C))),
                                     _mm256_and_si256(_mm256_srli_epi16(r2, 2), _mm256_set1_epi8(0x30)));
            }
            const auto finish = [&](int r, __m256i total) {
                const __m256i xs = load(x.sum + r * sums_per_row + k0 / 16);
                return _mm256_sub_epi32(total, _mm256_slli_epi32(_mm256_madd_epi16(xs, sc16), 5));
            };
            half(h, q0, q1, q2, q3, eight(h), row[h], [](int i) { return load(T == Q6_K ? PAIRED[i] : QUAD[i]); },
                 finish);
        }
        return {f16(blk + 208), 0.f};
    }
}

// The float step of one block for rows [0, R): each row's whole integer sum (part[r]'s lanes
// added, exactly) times d, less its mins' sum (mins[r]'s lanes) times dmin, times x's scale sx
// (row r's at sx[r * stride]), onto row 8 g + j's lane j of acc[g]: the same float operations
// for a row in any lane of either width, so the same bits whatever the rows beside it.
template <int64_t T>
static inline void settle_rows(float d, float dmin, const float* sx, int64_t stride, int R, const __m256i* part,
                               const __m128i* mins, __m256* acc) {
    const auto half_sum = [](__m256i p) { return _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)); };
    for (int g = 0; 8 * g < R; ++g) {
        const int n = std::min(8, R - 8 * g);
        const __m256i* p = part + 8 * g;
        const __m128i* m = mins + 8 * g;
        const float* s = sx + 8 * g * stride;
        if (n == 1) {                    // one row (a decode of one sequence): in lane 0
            const auto sum4 = [](__m128i t) {
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
                return _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
            };
            __m128 v = _mm_mul_ss(_mm_cvtepi32_ps(sum4(half_sum(p[0]))), _mm_set_ss(d));
            if constexpr (has_mins(T)) v = _mm_fnmadd_ss(_mm_cvtepi32_ps(sum4(m[0])), _mm_set_ss(dmin), v);
            acc[g] = _mm256_castps128_ps256(_mm_fmadd_ss(v, _mm_load_ss(s), _mm256_castps256_ps128(acc[g])));
        } else if (n <= 4) {             // lanes 0 .. n of the low half
            __m128i t[4];
            alignas(16) float s4[4] = {};
            for (int j = 0; j < n; ++j) t[j] = half_sum(p[j]), s4[j] = s[j * stride];
            __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(row_sums4(t, n)), _mm_set1_ps(d));
            if constexpr (has_mins(T)) v = _mm_fnmadd_ps(_mm_cvtepi32_ps(row_sums4(m, n)), _mm_set1_ps(dmin), v);
            acc[g] = _mm256_castps128_ps256(_mm_fmadd_ps(v, _mm_load_ps(s4), _mm256_castps256_ps128(acc[g])));
        } else {
            alignas(32) float s8[8] = {};
            for (int j = 0; j < n; ++j) s8[j] = s[j * stride];
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(row_sums8(p, n)), _mm256_set1_ps(d));
            if constexpr (has_mins(T)) v = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(row_sums8(m, n)), _mm256_set1_ps(dmin), v);
            acc[g] = _mm256_fmadd_ps(v, _mm256_load_ps(s8), acc[g]);
        }
    }
}

// One output's weight block `blk` (the b-th of its row) against rows [0, R) of the tile at x
// (x.q, x.scale and x.sum already at the tile's first row): acc[r] += the block's share of
// row r's output (lane-wise; off[r] a scalar share where the type has one). `part` holds a
// K-quant's integer sums per row. ROWS: R known when compiled (a decode's few rows,
// whose sums then stay in registers), or 0.
template <int64_t T, int ROWS = 0>
static inline void block(const uint8_t* blk, const Act& x, int64_t b, int rows, __m256* acc, float* off,
                         __m256i* part) {
    constexpr Traits tr = traits(T);
    const int R = ROWS ? ROWS : rows;
    const int64_t K = x.K, k0 = b * tr.block;
    const int64_t scales_per_row = K / tr.act, sums_per_row = K / tr.unit;
    if constexpr (tr.order == X4) {
        // Four blocks interleaved, x in the same order (kernels/gguf_quant.py's _X4_ORDER): every
        // 4-byte lane of a vector holds weights of one block, lane L of block L % 4 in each half.
        // A row's products then sum into int32 lanes of one block each and take one float step,
        // each lane its block's d times x's scale there: no reduction across lanes. Q5_0's q stay
        // unsigned (0..31, no sign steps), add up in int16 across the four vectors first (at most
        // 4 * 2 * 31 * 127 = 31496), and its -16 comes off as 16 times x's sum over each block,
        // in the block's lane of the low half. Q8_0's pairs fill int16 already. VNNI's form sums
        // both types' bytes in int32 directly, in two chains.
        const __m256i ones = _mm256_set1_epi16(1);
        const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)blk));
        const __m256 d = _mm256_set_m128(d4, d4);
        __m256i q[4], u[4];
        const __m256i fifth = T == Q5_0x4 ? x4_fifth(blk) : _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            q[j] = T == Q5_0x4 ? x4_vector(blk, fifth, j) : load(blk + 8 + 32 * j);
            u[j] = T == Q5_0x4 ? q[j] : _mm256_sign_epi8(q[j], q[j]);
        }
        for (int r = 0; r < R; ++r) {
            const int8_t* xr = x.q + r * K + k0;
            __m256i xv[4];
            for (int j = 0; j < 4; ++j) xv[j] = T == Q5_0x4 ? load(xr + 32 * j) : _mm256_sign_epi8(load(xr + 32 * j), q[j]);
#ifdef SLUICE_VNNI_FORM     // two chains of byte dot products in int32
            const __m256i zero = _mm256_setzero_si256();
            __m256i lanes = _mm256_add_epi32(dot_u8s8(dot_u8s8(zero, u[0], xv[0], ones), u[1], xv[1], ones),
                                             dot_u8s8(dot_u8s8(zero, u[2], xv[2], ones), u[3], xv[3], ones));
#else                       // Q5_0's four vectors add up in int16 before their one madd
            __m256i p[4];
            for (int j = 0; j < 4; ++j) p[j] = _mm256_maddubs_epi16(u[j], xv[j]);
            __m256i lanes = T == Q5_0x4
                ? _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones)
                : _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones)),
                                   _mm256_add_epi32(_mm256_madd_epi16(p[2], ones), _mm256_madd_epi16(p[3], ones)));
#endif
            if constexpr (T == Q5_0x4)
                lanes = _mm256_sub_epi32(lanes, _mm256_zextsi128_si256(_mm_slli_epi32(_mm_cvtepi16_epi32(
                            _mm_loadl_epi64((const __m128i*)(x.sum + r * sums_per_row + k0 / 32))), 4)));
            const __m256 scale = _mm256_mul_ps(d, _mm256_broadcast_ps((const __m128*)(x.scale + r * scales_per_row + k0 / 32)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), scale, acc[r]);
        }
    } else if constexpr (tr.block == 32) {         // one unit of 32
        const __m256i ones = _mm256_set1_epi16(1);
        float d;
        const __m256i q = unit<T>(blk, d), u = T == Q4_1 ? q : _mm256_sign_epi8(q, q);
        for (int r = 0; r < R; ++r) {
            __m256i xv = load(x.q + r * K + k0);
            if constexpr (T != Q4_1) xv = _mm256_sign_epi8(xv, q);
            const float sx = x.scale[r * scales_per_row + b];
            acc[r] = scaled(acc[r], dot_u8s8(_mm256_setzero_si256(), u, xv, ones), d * sx);
            if constexpr (T == Q4_1) off[r] += f16(blk + 2) * sx * (float)x.sum[r * sums_per_row + b];
        }
    } else {                                        // a K-quant: its integer sums, then one float step
        __m128i mins[ROWS ? ROWS : TILE];
        const auto [d, dmin] = kquant<T, ROWS>(blk, x, b, R, part, mins);
        settle_rows<T>(d, dmin, x.scale + b, scales_per_row, R, part, mins, acc);
    }
}

// Outputs n of rows [0, R) from their sums acc (and off): per row, or per lane (rows_in_lanes).
template <int64_t T>
static inline void put(const Out& O, int64_t m0, int64_t n, int R, const __m256* acc, const float* off) {
    if constexpr (rows_in_lanes(T)) {
        alignas(32) float v[TILE];
        for (int g = 0; 8 * g < R; ++g) _mm256_store_ps(v + 8 * g, acc[g]);
        for (int r = 0; r < R; ++r) O.put(m0 + r, n, v[r]);
    } else {
        for (int r = 0; r < R; ++r) O.put(m0 + r, n, hsum(acc[r]) + off[r]);
    }
}

template <int64_t T>
static inline void prefetch(const uint8_t* blk) {
    for (int64_t at = 0; at < traits(T).bytes; at += 64) _mm_prefetch((const char*)(blk + PREFETCH + at), _MM_HINT_T0);
}

// A decode's R rows of x (R <= DECODE, known when compiled) times outputs [0, N), the outputs
// one at a time: their weights stream in one sequential run, which the prefetchers (ours
// PREFETCH bytes ahead, and the hardware's) keep ahead of, and each row's sums stay in
// registers across the blocks.
template <int64_t T, int R>
static void decode(const Act& x, const uint8_t* W, const Out& O, int64_t N) {
    constexpr Traits tr = traits(T);
    const int64_t blocks = x.K / tr.block, row_bytes = blocks * tr.bytes;
    at::parallel_for(0, N, GROUP, [&](int64_t n0, int64_t n1) {
        // A copy of x's pointers that nothing else can reach: stores through the __m256i sums
        // (which may alias anything) would otherwise reload them from memory every block.
        const Act xs = x;
        for (int64_t n = n0; n < n1; ++n) {
            __m256 acc[R];
            float off[R];
            __m256i part[R];
            for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), off[r] = 0.f;
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* blk = W + n * row_bytes + b * tr.bytes;
                prefetch<T>(blk);
                block<T, R>(blk, xs, b, R, acc, off, part);
            }
            put<T>(O, 0, n, R, acc, off);
        }
    });
}

// x's rows [0, M) times outputs [0, N). Up to DECODE rows: `decode`. More: tiles of TILE rows,
// each against every output in turns of GROUP outputs, those against each block in turn.
template <int64_t T>
static void linear(const Act& x, const uint8_t* W, const Out& O, int64_t M, int64_t N) {
    static_assert(DECODE == 8, "one decode instantiation per row count up to DECODE");
    switch (M) {
        case 1: return decode<T, 1>(x, W, O, N);
        case 2: return decode<T, 2>(x, W, O, N);
        case 3: return decode<T, 3>(x, W, O, N);
        case 4: return decode<T, 4>(x, W, O, N);
        case 5: return decode<T, 5>(x, W, O, N);
        case 6: return decode<T, 6>(x, W, O, N);
        case 7: return decode<T, 7>(x, W, O, N);
        case 8: return decode<T, 8>(x, W, O, N);
    }
    constexpr Traits tr = traits(T);
    const int64_t K = x.K, blocks = K / tr.block, row_bytes = blocks * tr.bytes;
    at::parallel_for(0, N, GROUP, [&](int64_t n0, int64_t n1) {
        __m256 acc[GROUP * TILE];
        float off[GROUP * TILE];
        __m256i part[TILE];
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int R = (int)std::min<int64_t>(TILE, M - m0);
            const Act tile{x.q + m0 * K, x.scale + m0 * (K / tr.act), x.sum + m0 * (K / tr.unit),
                           x.mult ? x.mult + m0 * (K / 32) : nullptr, K};
            for (int64_t n = n0; n < n1; n += GROUP) {
                const int G = (int)std::min<int64_t>(GROUP, n1 - n);
                for (int g = 0; g < G; ++g)
                    for (int r = 0; r < R; ++r) acc[g * TILE + r] = _mm256_setzero_ps(), off[g * TILE + r] = 0.f;
                for (int64_t b = 0; b < blocks; ++b)
                    for (int g = 0; g < G; ++g) {
                        const uint8_t* blk = W + (n + g) * row_bytes + b * tr.bytes;
                        prefetch<T>(blk);
                        block<T>(blk, tile, b, R, acc + g * TILE, off + g * TILE, part);
                    }
                for (int g = 0; g < G; ++g) put<T>(O, m0, n + g, R, acc + g * TILE, off + g * TILE);
            }
        }
    });
}

// x per block of B values as int8 (in `x_order`), and the integer sum of every U
// values. One scale per block (`mult` null: max(|x|max, 1e-8) / 127, x / scale rounded half to
// even: kernels/quant_matmul.py's quantize_rows), or a step per 32 values, a multiple m
// (1..steps) of the block's scale d = max(|x|max, 1e-8) / (127 steps), and sums in those steps
// (kernels/gguf_quant.py's quantize_steps, to the bit: the same float operations in the same order).
static void quantize(const float* x, int64_t M, int64_t K, int64_t B, int64_t U, Order x_order, int8_t* q, float* xs,
                     int16_t* xi, int16_t* mult, int steps) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const auto run_max = [&](const float* p) {
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t k = 0; k < 32; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(magnitude, _mm256_loadu_ps(p + k)));
        return hmax(vmax);
    };
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t i = m0 * K; i < m1 * K; i += B) {
            float runs[256 / 32], top = 0.f;
            for (int64_t k = 0; k < B; k += 32) top = std::max(top, runs[k / 32] = run_max(x + i + k));
            top = std::max(top, 1e-8f);
            const float s = mult ? top / (127.f * steps) : top / 127.f;
            xs[i / B] = s;
            for (int64_t k = 0; k < B; k += 32) {
                int m = 1;
                if (mult) mult[(i + k) / 32] = (int16_t)(m = std::min(steps, (int)std::floor(runs[k / 32] * steps / top) + 1));
                const __m256 vs = _mm256_set1_ps(s * (float)m);
                __m256i v[4];             // _mm256_cvtps_epi32 rounds half to even
                for (int j = 0; j < 4; ++j) v[j] = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + i + k + 8 * j), vs));
                const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
                _mm256_storeu_si256((__m256i*)(q + i + k), _mm256_permutevar8x32_epi32(bytes, order));
                const __m256i lo = _mm256_add_epi32(v[0], v[1]), hi = _mm256_add_epi32(v[2], v[3]);
                if (U == 16) {
                    xi[(i + k) / 16] = (int16_t)(m * hsum_epi32(lo));
                    xi[(i + k) / 16 + 1] = (int16_t)(m * hsum_epi32(hi));
                } else {
                    xi[(i + k) / 32] = (int16_t)(m * hsum_epi32(_mm256_add_epi32(lo, hi)));
                }
            }
        }
        // The x4 layouts' order: byte 16 h + 4 b + i of vector k is x[32 b + 8 k + 4 h + i], per 128 values.
        if (x_order == X4)
            for (int64_t i = m0 * K; i < m1 * K; i += 128) {
                int8_t in_order[128];
                std::memcpy(in_order, q + i, 128);
                for (int p = 0; p < 128; p += 4)
                    std::memcpy(q + i + p, in_order + 32 * (p % 16 / 4) + 8 * (p / 32) + 4 * (p % 32 / 16), 4);
            }
        // Q4_Kx's pairs: per 64 values (two units), the first 16 of each unit, then the last 16 of each.
        if (x_order == PAIRS)
            for (int64_t i = m0 * K; i < m1 * K; i += 64) {
                int8_t second[16];
                std::memcpy(second, q + i + 16, 16);
                std::memcpy(q + i + 16, q + i + 32, 16);
                std::memcpy(q + i + 32, second, 16);
            }
        // Q6_Kx's quads: per 64 values (four units of 16), the first 8 of each unit, then the last 8 of each.
        if (x_order == QUADS)
            for (int64_t i = m0 * K; i < m1 * K; i += 64) {
                int8_t in_order[64];
                std::memcpy(in_order, q + i, 64);
                for (int c = 0; c < 8; ++c) std::memcpy(q + i + 8 * c, in_order + 8 * (2 * (c % 4) + c / 4), 8);
            }
    });
}

}  // namespace

// x float32 [M, K] times a layer stored as `parts`: GGUF tensors uint8 [N_i, K / block * bytes] of
// `types`, their outputs side by side (a fused q|k|v may mix types), plus `bias` -> float32
// [M, sum N_i]. x is quantized once per activation layout the parts need, into buffers this
// thread keeps across calls (a decode step makes a few hundred calls).
torch::Tensor gguf_linear(const torch::Tensor& x_, at::TensorList parts, at::IntArrayRef types,
                          const c10::optional<torch::Tensor>& bias, int64_t steps) {
    TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "gguf_linear: one type per part");
    TORCH_CHECK(steps >= 1 && steps <= MAX_STEPS, "gguf_linear: steps ", steps, " is not 1 to ", MAX_STEPS);
    const torch::Tensor x = x_.contiguous();
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "gguf_linear: x float32 [M, K]");
    const int64_t M = x.size(0), K = x.size(1);
    int64_t N = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
        const int64_t type = types[i];
        const torch::Tensor& w = parts[i];
        TORCH_CHECK(type >= Q8_0 && type <= Q6_Kx, "gguf_linear: unknown type ", type);
        const Traits tr = traits(type);
        TORCH_CHECK(K % tr.block == 0, "gguf_linear: K = ", K, " is not a multiple of the type's block ", tr.block);
        TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() &&
                    w.size(1) == K / tr.block * tr.bytes, "gguf_linear: w uint8 [N, ", K / tr.block * tr.bytes, "]");
        N += w.size(0);
    }
    const float* b = nullptr;
    if (bias && bias->defined()) {
        TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous(), "gguf_linear: bias float32 [", N, "]");
        b = bias->data_ptr<float>();
    }
    auto out = torch::empty({M, N}, x.options());
    struct Quantized { std::vector<int8_t> q; std::vector<float> scale; std::vector<int16_t> sum, mult; };
    thread_local std::map<std::tuple<int64_t, int64_t, int>, Quantized> scratch;     // by (act, unit, order)
    int64_t n0 = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
        const Traits tr = traits(types[i]);
        const bool stepped = tr.act > 32 && steps > 1;
        Quantized& a = scratch[{tr.act, tr.unit, tr.order}];
        const bool first = std::none_of(types.begin(), types.begin() + i, [&](int64_t t) {
            return traits(t).act == tr.act && traits(t).unit == tr.unit && traits(t).order == tr.order; });
        if (first) {                // no earlier part quantized x this way
            a.q.resize(M * K), a.scale.resize(M * K / tr.act), a.sum.resize(M * K / tr.unit);
            a.mult.resize(M * K / 32);
            quantize(x.data_ptr<float>(), M, K, tr.act, tr.unit, tr.order, a.q.data(), a.scale.data(), a.sum.data(),
                     stepped ? a.mult.data() : nullptr, (int)steps);
        }
        const Act act{a.q.data(), a.scale.data(), a.sum.data(), stepped ? a.mult.data() : nullptr, K};
        const uint8_t* W = parts[i].data_ptr<uint8_t>();
        const Out O{out.data_ptr<float>() + n0, N, b ? b + n0 : nullptr};
        const int64_t n = parts[i].size(0);
        switch (types[i]) {
            case Q8_0: linear<Q8_0>(act, W, O, M, n); break;
            case Q5_0: linear<Q5_0>(act, W, O, M, n); break;
            case Q4_1: linear<Q4_1>(act, W, O, M, n); break;
            case Q4_K: linear<Q4_K>(act, W, O, M, n); break;
            case Q5_0x4: linear<Q5_0x4>(act, W, O, M, n); break;
            case Q4_Kx: linear<Q4_Kx>(act, W, O, M, n); break;
            case Q8_0x4: linear<Q8_0x4>(act, W, O, M, n); break;
            case Q6_K: linear<Q6_K>(act, W, O, M, n); break;
            default: linear<Q6_Kx>(act, W, O, M, n);
        }
        n0 += n;
    }
    return out;
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.def("gguf_linear(Tensor x, Tensor[] parts, int[] types, Tensor? bias, int steps=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
    m.impl("gguf_linear", &gguf_linear);
}
