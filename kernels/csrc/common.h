// What every compiled CPU kernel shares: a float32 vector's horizontal sum and max, and the integer
// dot products that AVX-512 VNNI does in one instruction. Built for AVX2 and FMA, and for VNNI where
// the host has it (kernels/cpu_build.py); the build folder's name hashes this header with the
// sources, so editing it rebuilds every extension.
#pragma once

#include <immintrin.h>

// SLUICE_VNNI: built for AVX-512 VNNI. SLUICE_VNNI_FORM: the kernels take the shapes that suit its
// instructions; set by SLUICE_VNNI, or alone on AVX2, where the helpers below take AVX2's
// instructions for the same integers: the tests build that form to check a VNNI build's arithmetic
// on a host without VNNI.
#ifdef SLUICE_VNNI
#define SLUICE_VNNI_FORM
#endif

// acc + the products of unsigned u and signed s bytes, summed in fours, in int32. VNNI does it in
// one instruction; AVX2 in three, through int16 pairs (maddubs), which cannot saturate where every
// caller keeps 2 u |s| below 2**15 (u <= 128, |s| <= 127): the same integers either way.
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s, __m256i ones) {
#ifdef SLUICE_VNNI
    (void)ones;
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
#endif
}

// acc + the products of int16 a and b, summed in pairs, in int32: one instruction on VNNI, two on AVX2.
static inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) {
#ifdef SLUICE_VNNI
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

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
