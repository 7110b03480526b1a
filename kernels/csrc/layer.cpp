// A decoder layer's kernels other than its matmuls, for kernels/layer_cpu.py: the residual add and
// RMSNorm, rotary with the KV cache write, the SiLU product, and attention of decode tokens over
// the paged cache. At batch 1 a step is mostly small operators: each PyTorch twin makes five to a
// dozen calls, these make one, reading the block table where the cache is.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

// exp by Cephes' expf: x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n by the exponent
// bits; within about 2 ulp of expf over [-87, 88], 0 below.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float exp1(float x) {
    float in[8] = {x}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

static inline float dot(const float* a, const float* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

// y += a * x
static inline void axpy(float a, const float* x, float* y, int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
}

using Tensor = torch::Tensor;
using Optional = c10::optional<torch::Tensor>;

static void check_float(const Tensor& t, const char* name, const char* what) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.device().is_cpu(), name, ": ", what,
                " must be float32 on the CPU");
}

// (rms_norm(x + residual) * weight, x + residual) over the last dim; no residual: h is x.
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x_, const Optional& residual, const Tensor& weight_, double eps) {
    check_float(x_, "add_rms_norm", "x");
    const Tensor x = x_.contiguous(), weight = weight_.contiguous();
    const int64_t H = x.size(-1), M = x.numel() / H;
    Tensor h = x_, r;
    if (residual.has_value()) {
        r = residual->contiguous();
        TORCH_CHECK(r.sizes() == x.sizes(), "add_rms_norm: residual must have x's shape");
        h = torch::empty_like(x);
    }
    auto out = torch::empty_like(x);
    const float *X = x.data_ptr<float>(), *W = weight.data_ptr<float>();
    const float* R = r.defined() ? r.data_ptr<float>() : nullptr;
    float *Hp = r.defined() ? h.data_ptr<float>() : nullptr, *O = out.data_ptr<float>();
    at::parallel_for(0, M, std::max<int64_t>(1, 32768 / H), [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
            const float* xr = X + m * H;
            if (R) {
                float* hr = Hp + m * H;
                for (int64_t i = 0; i < H; ++i) hr[i] = xr[i] + R[m * H + i];
                xr = hr;
            }
            const float inv = 1.f / std::sqrt(dot(xr, xr, H) / float(H) + float(eps));
            for (int64_t i = 0; i < H; ++i) O[m * H + i] = W[i] * (xr[i] * inv);
        }
    });
    return {out, h};
}

// x [..., 2I] (gate | up) -> silu(gate) * up [..., I]
Tensor silu_and_mul(const Tensor& x_) {
    check_float(x_, "silu_and_mul", "x");
    const Tensor x = x_.contiguous();
    const int64_t I = x.size(-1) / 2, M = x.numel() / (2 * I);
    auto sizes = x.sizes().vec();
    sizes.back() = I;
    auto out = torch::empty(sizes, x.options());
    const float* X = x.data_ptr<float>();
    float* O = out.data_ptr<float>();
    at::parallel_for(0, M * I, 8192, [&](int64_t a, int64_t b) {
        for (int64_t j = a; j < b; ) {
            const int64_t i = j % I;
            const float* gate = X + (j / I) * 2 * I + i;
            if (i + 8 <= I && j + 8 <= b) {
                const __m256 g = _mm256_loadu_ps(gate);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
                const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
                _mm256_storeu_ps(O + j, _mm256_mul_ps(s, _mm256_loadu_ps(gate + I)));
                j += 8;
            } else {
                O[j++] = gate[0] / (1.f + exp1(-gate[0])) * gate[I];
            }
        }
    });
    return out;
}

// kernels/attention.py's quantize_kv for one row of d values: scale absmax / 127, values
// rounded half away from zero.
static void quantize_row(const float* x, int64_t d, int8_t* q, float* scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = amax / 127.f, div = s > 0.f ? s : 1.f;
    *scale = s;
    for (int64_t i = 0; i < d; ++i) {
        const float v = x[i] / div;
        q[i] = (int8_t)std::max(-127.f, std::min(127.f, std::trunc(v + 0.5f * (v > 0.f ? 1.f : v < 0.f ? -1.f : 0.f))));
    }
}

// Rotary (Hugging Face's halves layout) on q [T, heads, d] and k [T, kv_heads, d]; the rotated
// k and v written to their slots (quantized where the cache is int8). Returns the rotated q.
Tensor rotary_store_kv(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos_, const Tensor& sin_,
                       Tensor k_cache, Tensor v_cache, const Tensor& slot_mapping_, const Optional& k_scale,
                       const Optional& v_scale) {
    check_float(q, "rotary_store_kv", "q");
    for (const auto* t : {&q, &k, &v})
        TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                    t->scalar_type() == torch::kFloat,
                    "rotary_store_kv: q, k, v float32 [T, heads, d], each row's heads contiguous");
    const Tensor cos = cos_.contiguous(), sin = sin_.contiguous(), slots = slot_mapping_.to(torch::kLong).contiguous();
    const bool int8 = k_scale.has_value();
    TORCH_CHECK(int8 ? k_cache.scalar_type() == torch::kChar : k_cache.scalar_type() == torch::kFloat,
                "rotary_store_kv: the cache is float32, or int8 with scales");
    const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2), half = D / 2;
    auto out = torch::empty({T, H, D}, q.options());
    const float *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    auto rotate = [&](const float* x, int64_t t, float* y) {
        for (int64_t i = 0; i < half; ++i) {
            const float c = C[t * half + i], s = S[t * half + i], x1 = x[i], x2 = x[i + half];
            y[i] = x1 * c - x2 * s;
            y[i + half] = x2 * c + x1 * s;
        }
    };
    std::vector<float> row(D);
    for (int64_t t = 0; t < T; ++t) {
        const float *qt = q.data_ptr<float>() + t * q.stride(0), *kt = k.data_ptr<float>() + t * k.stride(0),
                    *vt = v.data_ptr<float>() + t * v.stride(0);
        for (int64_t h = 0; h < H; ++h) rotate(qt + h * D, t, out.data_ptr<float>() + (t * H + h) * D);
        for (int64_t h = 0; h < KVH; ++h) {
            const int64_t at = slot[t] * KVH + h;
            if (int8) {
                rotate(kt + h * D, t, row.data());
                quantize_row(row.data(), D, k_cache.data_ptr<int8_t>() + at * D, k_scale->data_ptr<float>() + at);
                quantize_row(vt + h * D, D, v_cache.data_ptr<int8_t>() + at * D, v_scale->data_ptr<float>() + at);
            } else {
                rotate(kt + h * D, t, k_cache.data_ptr<float>() + at * D);
                std::copy(vt + h * D, vt + (h + 1) * D, v_cache.data_ptr<float>() + at * D);
            }
        }
    }
    return out;
}

// One query token per sequence, q [S, heads, d], over the paged cache [blocks, block_size, kv_heads, d]:
// per sequence and KV head, the query heads sharing it scored against each cached key (read
// through the block table), softmax, and the values summed with those weights.
Tensor paged_decode_attention(const Tensor& q_, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& block_tables_, const Tensor& context_lens_, double scale,
                              const Optional& k_scale, const Optional& v_scale) {
    check_float(q_, "paged_decode_attention", "q");
    const Tensor q = q_.contiguous(), tables = block_tables_.to(torch::kLong).contiguous(),
                        lens = context_lens_.to(torch::kLong).contiguous();
    const bool int8 = k_scale.has_value();
    TORCH_CHECK(int8 ? k_cache.scalar_type() == torch::kChar : k_cache.scalar_type() == torch::kFloat,
                "paged_decode_attention: the cache is float32, or int8 with scales");
    const int64_t S = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
    const int64_t G = H / KVH, MB = tables.size(1);
    auto out = torch::empty_like(q);
    const float* Q = q.data_ptr<float>();
    float* O = out.data_ptr<float>();
    const int64_t *BT = tables.data_ptr<int64_t>(), *L = lens.data_ptr<int64_t>();
    at::parallel_for(0, S * KVH, 1, [&](int64_t a, int64_t b) {
        std::vector<float> scores, acc(G * D), krow(D), vrow(D);
        for (int64_t job = a; job < b; ++job) {
            const int64_t s = job / KVH, kh = job % KVH, n = L[s];
            scores.resize(G * n);
            auto row = [&](const Tensor& cache, const c10::optional<torch::Tensor>& sc, int64_t p, float* buf) {
                const int64_t at = (BT[s * MB + p / BS] * BS + p % BS) * KVH + kh;
                if (!int8) return (const float*)cache.data_ptr<float>() + at * D;
                const int8_t* r = cache.data_ptr<int8_t>() + at * D;
                const float f = sc->data_ptr<float>()[at];
                for (int64_t i = 0; i < D; ++i) buf[i] = float(r[i]) * f;
                return (const float*)buf;
            };
            for (int64_t p = 0; p < n; ++p) {
                const float* kr = row(k_cache, k_scale, p, krow.data());
                for (int64_t g = 0; g < G; ++g)
                    scores[g * n + p] = dot(Q + (s * H + kh * G + g) * D, kr, D) * float(scale);
            }
            std::vector<float> total(G);
            for (int64_t g = 0; g < G; ++g) {
                float* sc = scores.data() + g * n;
                __m256 mv = _mm256_set1_ps(-INFINITY);
                int64_t p = 0;
                for (; p + 8 <= n; p += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + p));
                float m = hmax(mv);
                for (; p < n; ++p) m = std::max(m, sc[p]);
                __m256 sum = _mm256_setzero_ps();
                const __m256 mb = _mm256_set1_ps(m);
                for (p = 0; p + 8 <= n; p += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + p), mb));
                    _mm256_storeu_ps(sc + p, e);
                    sum = _mm256_add_ps(sum, e);
                }
                float t = hsum(sum);
                for (; p < n; ++p) t += (sc[p] = exp1(sc[p] - m));
                total[g] = t;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t p = 0; p < n; ++p) {
                const float* vr = row(v_cache, v_scale, p, vrow.data());
                for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + p], vr, acc.data() + g * D, D);
            }
            for (int64_t g = 0; g < G; ++g) {
                float* o = O + (s * H + kh * G + g) * D;
                for (int64_t i = 0; i < D; ++i) o[i] = acc[g * D + i] / total[g];
            }
        }
    });
    return out;
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
    m.def("silu_and_mul(Tensor x) -> Tensor");
    m.def("rotary_store_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor slot_mapping, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor");
    m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor context_lens, float scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("silu_and_mul", &silu_and_mul);
    m.impl("rotary_store_kv", &rotary_store_kv);
    m.impl("paged_decode_attention", &paged_decode_attention);
}
