// A decode step's decoder layers as one call, for kernels/decoder_cpu.py: the CPU's counterpart of
// a CUDA graph. Python between a layer's dozen operators cost 11-19% of a batch-1 step; here C++
// calls the same operators (layer.cpp's and quant_matmul.cpp's, through torch's dispatcher) in the
// same order on the same tensors, so the result is the Python path's to the bit.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

using Tensor = torch::Tensor;
using Optional = c10::optional<torch::Tensor>;

// The operators by name, each looked up once; the function types are the kernels' own.
template <typename F>
static c10::TypedOperatorHandle<F> find(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Proj {
    int64_t kind;                 // 0: float32 weight_t [K, N]; 1: int8 w [N, K]; 2: int4 w [N, K / 2]; 3: gguf
    Tensor w, scales, zero_scales, bias;
    int64_t block;                // int8: activations per scale; int4: the group
    std::vector<Tensor> parts;    // gguf: the stored blocks of each run of outputs of one type, in order
    std::vector<int64_t> types;   // gguf: their types (gguf_linear.cpp's)
    int64_t steps;                // gguf: x's steps per K-quant block (gguf_linear.cpp's)
};

struct Decoder : torch::CustomClassHolder {
    int64_t heads, kv_heads, head_dim;
    double eps, scale;
    std::vector<Proj> projs;                 // per layer: q|k|v, o, gate|up, down
    std::vector<Tensor> norms;               // per layer: input, post-attention; then the final one
    std::vector<Tensor> k_caches, v_caches;
    std::vector<Optional> k_scales, v_scales;

    Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
        : heads(heads), kv_heads(kv_heads), head_dim(head_dim), eps(eps), scale(scale) {}

    void add_proj(int64_t kind, Tensor w, Optional scales, Optional zero_scales, Optional bias, int64_t block) {
        TORCH_CHECK(kind >= 0 && kind <= 2, "Decoder.add_proj: kind 0 (float32), 1 (int8) or 2 (int4)");
        projs.push_back({kind, w, scales.value_or(Tensor()), zero_scales.value_or(Tensor()),
                         bias.value_or(Tensor()), block, {}, {}, 1});
    }

    // A projection on a GGUF's own blocks (engine/quantize.py's GGUFLinear): a fused q|k|v may
    // mix types, each run of outputs of one type a part of the one call, as GGUFLinear.forward makes it.
    void add_gguf_proj(std::vector<Tensor> parts, std::vector<int64_t> types, Optional bias, int64_t steps) {
        TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "Decoder.add_gguf_proj: one type per part");
        projs.push_back({3, Tensor(), Tensor(), Tensor(), bias.value_or(Tensor()), 0, parts, types, steps});
    }

    void add_norm(Tensor w) { norms.push_back(w); }

    void add_cache(Tensor k, Tensor v, Optional k_scale, Optional v_scale) {
        k_caches.push_back(k);
        v_caches.push_back(v);
        k_scales.push_back(k_scale);
        v_scales.push_back(v_scale);
    }

    Tensor linear(const Proj& p, const Tensor& x) const {
        static auto int8 = find<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)>("sluice::int8_linear");
        static auto int4 = find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t)>(
            "sluice::int4_linear");
        if (p.kind == 0) return p.bias.defined() ? at::addmm(p.bias, x, p.w) : at::mm(x, p.w);
        if (p.kind == 3) {           // the kernel adds the bias
            static auto gguf = find<Tensor(const Tensor&, at::ArrayRef<Tensor>, at::ArrayRef<int64_t>, const Optional&,
                                           int64_t)>("sluice::gguf_linear");
            return gguf.call(x, p.parts, p.types, p.bias.defined() ? Optional(p.bias) : c10::nullopt, p.steps);
        }
        const Tensor y = p.kind == 1 ? int8.call(x, p.w, p.scales, p.block) : int4.call(x, p.w, p.scales, p.zero_scales, p.block);
        return p.bias.defined() ? y + p.bias : y;
    }

    // x [T, hidden]: the embeddings of T decode tokens, one per sequence; cos, sin [T, 1, d / 2];
    // returns the final norm's output, as CausalLM.forward does.
    Tensor decode(Tensor x, Tensor cos, Tensor sin, Tensor slots, Tensor tables, Tensor lens) const {
        static auto norm = find<std::tuple<Tensor, Tensor>(const Tensor&, const Optional&, const Tensor&, double)>(
            "sluice::add_rms_norm");
        static auto silu = find<Tensor(const Tensor&)>("sluice::silu_and_mul");
        static auto rotary = find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                         Tensor, Tensor, const Tensor&, const Optional&, const Optional&)>(
            "sluice::rotary_store_kv");
        static auto attention = find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                            double, const Optional&, const Optional&)>(
            "sluice::paged_decode_attention");
        const int64_t L = k_caches.size(), T = x.size(0), H = heads, KVH = kv_heads, D = head_dim;
        TORCH_CHECK(L > 0 && (int64_t)projs.size() == 4 * L && (int64_t)norms.size() == 2 * L + 1,
                    "Decoder: ", L, " caches, ", projs.size(), " projections, ", norms.size(), " norms");
        Tensor residual = x, h;
        for (int64_t l = 0; l < L; ++l) {
            // The residual add is fused into the next norm, as DecoderLayer does.
            std::tie(h, residual) = l == 0 ? std::make_tuple(std::get<0>(norm.call(x, c10::nullopt, norms[0], eps)), x)
                                           : norm.call(x, residual, norms[2 * l], eps);
            const Tensor qkv = linear(projs[4 * l], h);
            const Tensor q = rotary.call(qkv.narrow(1, 0, H * D).view({T, H, D}),
                                         qkv.narrow(1, H * D, KVH * D).view({T, KVH, D}),
                                         qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D}), cos, sin,
                                         k_caches[l], v_caches[l], slots, k_scales[l], v_scales[l]);
            const Tensor out = attention.call(q, k_caches[l], v_caches[l], tables, lens, scale, k_scales[l],
                                              v_scales[l]);
            std::tie(h, residual) = norm.call(linear(projs[4 * l + 1], out.reshape({T, H * D})), residual,
                                              norms[2 * l + 1], eps);
            x = linear(projs[4 * l + 3], silu.call(linear(projs[4 * l + 2], h)));
        }
        return std::get<0>(norm.call(x, residual, norms[2 * L], eps));
    }
};

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.class_<Decoder>("Decoder")
        .def(torch::init<int64_t, int64_t, int64_t, double, double>())
        .def("add_proj", &Decoder::add_proj)
        .def("add_gguf_proj", &Decoder::add_gguf_proj)
        .def("add_norm", &Decoder::add_norm)
        .def("add_cache", &Decoder::add_cache)
        .def("decode", &Decoder::decode);
}
