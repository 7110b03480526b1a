"""One decoder for Llama, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

The forward pass takes a step's tokens flattened into one batch, decodes first and then
prefill chunks, with their positions; attention reads and writes the paged KV cache through
the kernels package. Projections are fused (q|k|v, gate|up) so a layer costs four matmuls.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from kernels import (
    add_rms_norm,
    gemv_linear,
    paged_decode_attention,
    paged_prefill_attention,
    rotary_store_kv,
    silu_and_mul,
)


@dataclass
class StepBatch:
    """What attention needs to know about the step's flattened tokens."""
    slot_mapping: torch.Tensor                 # [T] cache slot of each new token
    num_decodes: int                           # the first num_decodes tokens are decodes
    # Per layer: k, v caches, and their per-token-and-head scales when the cache is int8.
    kv_caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    decode_block_tables: torch.Tensor | None = None     # [D, max_blocks]
    decode_context_lens: torch.Tensor | None = None     # [D]
    prefill_block_tables: torch.Tensor | None = None    # [P, max_blocks]
    prefill_context_lens: torch.Tensor | None = None    # [P]
    prefill_query_start: torch.Tensor | None = None     # [P + 1], relative to the first prefill token


class Module(nn.Module):
    """An nn.Module called straight through to its forward: the engine sets no hooks, and
    nn.Module's hook checks cost microseconds a call, some 250 calls a 1.5B decode step."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Linear(Module):
    """y = x W^T + b with W stored transposed, [in, out]: at decode's batch sizes the CPU
    GEMM streams an [in, out] weight about 1.7x faster than nn.Linear's [out, in] (measured
    here: ~26 against ~15 GB/s), and decode is bound by reading weights. On an H100 cuBLAS
    reads both layouts about equally fast at decode sizes (benchmarks/gpu_kernels.py: within 4% at
    1-64 rows). `gemv_rows`: for each row count below its length, whether to run the Triton GEMV
    (kernels.gemv_linear) rather than cuBLAS, a bf16 device's measured choice per decode batch
    bucket (engine/quantize.py's apply_gemv_buckets); empty, as built: the GEMM everywhere."""

    gemv_rows: tuple[bool, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < len(self.gemv_rows) and self.gemv_rows[rows]:
            return gemv_linear(x, self.weight_t, self.bias)
        return x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)

    row_block = 1      # `rows` takes any outputs

    def rows(self, ids: torch.Tensor) -> Linear:
        """This layer computing only the outputs `ids` (a copy of their weights)."""
        sub = Linear(0, 0, bias=False)
        sub.weight_t = nn.Parameter(self.weight_t[:, ids].contiguous(), requires_grad=False)
        sub.bias = None if self.bias is None else nn.Parameter(self.bias[ids], requires_grad=False)
        return sub


class RMSNorm(Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without a residual: the normed x. With one: (norm(x + residual), x + residual)."""
        out = add_rms_norm(x, residual, self.weight, self.eps)
        return out[0] if residual is None else out


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")
    return inv_freq.float()


class Rotary(Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # On the CPU even while load_model builds the model on "meta": the first math op on
        # meta costs seconds of one-time setup at every start.
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), rope_inv_freq(cfg))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's positions, looked up once for all layers."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


class Attention(Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.d ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: StepBatch,
                layer: int) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.kvh, self.d), v.view(T, self.kvh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache, k_scale, v_scale = batch.kv_caches[layer]
        q = rotary_store_kv(q, k, v, *rope, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        D = batch.num_decodes
        parts = []
        if D:
            parts.append(paged_decode_attention(q if D == T else q[:D], k_cache, v_cache, batch.decode_block_tables,
                                                batch.decode_context_lens, self.scale, k_scale, v_scale))
        if D < T:
            parts.append(paged_prefill_attention(q[D:], k_cache, v_cache, batch.prefill_block_tables,
                                                 batch.prefill_context_lens, batch.prefill_query_start,
                                                 self.scale, k_scale, v_scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(T, self.h * self.d))


class MLP(Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, rope, batch, layer):
        # The residual add is fused into the next norm (nano-vllm's layout).
        h, residual = self.input_layernorm(x, residual) if residual is not None else (self.input_layernorm(x), x)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, batch, layer), residual)
        return self.mlp(h), residual


class CausalLM(Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg)
        # Uninitialized: load_model fills it, and a random init on the meta device costs
        # seconds of one-time setup at every start.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied models keep a transposed copy for the head: lookups want [vocab, hidden] rows,
        # the head's GEMV wants [hidden, vocab].
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, batch, i)
        return self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def fused_rows(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """Hugging Face projection name -> (fused name, first row) in this model's layout."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q), "v_proj": ("qkv_proj", q + kv),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", cfg.intermediate_size)}


# An AWQ or GPTQ checkpoint's packed tensors of a Linear, read by engine/awq_gptq.py in place
# of its float weight.
PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def linear_sources(model: CausalLM) -> list[tuple[str, Linear, list[str]]]:
    """Each Linear's module name, the module, and the Hugging Face tensors (names without their
    `.weight`/`.qweight` suffix) whose rows it holds, in order: what a loader of stored weights
    (a GGUF's blocks, an AWQ/GPTQ checkpoint) reads for it."""
    fused = fused_rows(model.cfg)
    out = []
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            parent, _, child = name.rpartition(".")
            sources = [f"model.{parent}.{hf}" for hf, (into, _) in fused.items() if into == child] \
                or ["lm_head" if name == "lm_head" else f"model.{name}"]
            out.append((name, module, sources))
    return out


def load_model(folder: Path, cfg: ModelConfig | None = None, linear_weights: bool = True,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               embedding: bool = True) -> CausalLM:
    """Build the model from a Hugging Face safetensors folder straight onto `device` in `dtype`,
    one tensor at a time (the host never holds a second copy of the model). Without
    `linear_weights` the Linears' weights are neither read nor allocated (they stay on "meta"):
    for a caller that swaps them for cached quantized ones, so a quantized model never reads
    its float weights; without `embedding`, the same for the token embedding."""
    cfg = cfg or ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(cfg)
    skipped = lambda module, name: (name == "weight_t" and not linear_weights) or \
        (module is model.embed_tokens and not embedding)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not skipped(module, name):
                setattr(module, name, nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype),
                                                   requires_grad=False))
    model.rotary = Rotary(cfg).to(device)  # its buffers were left empty on the meta device; float32 tables
    params = dict(model.named_parameters())
    fused = fused_rows(cfg)
    filled = dict.fromkeys(params, 0)   # output units loaded per parameter

    def put(name: str, tensor: torch.Tensor, first: int = 0) -> None:
        if name.endswith(".weight") and name.removesuffix(".weight") + ".weight_t" in params:
            name, tensor = name.removesuffix(".weight") + ".weight_t", tensor.t()
            params[name].data[:, first:first + tensor.shape[1]].copy_(tensor)
            filled[name] += tensor.shape[1]
        elif name in params:
            params[name].data[first:first + tensor.shape[0]].copy_(tensor)
            filled[name] += tensor.shape[0]
        else:
            raise ValueError(f"{folder}: unexpected tensor {name!r}")

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and cfg.tie_embeddings):
                    continue
                name = hf_name.removeprefix("model.")
                parts = name.split(".")
                linear = (name.endswith(".weight") and (parts[-2] in fused or f"{name[:-7]}.weight_t" in params)) \
                    or parts[-1] in PACKED_PARTS
                if (linear and not linear_weights) or (name == "embed_tokens.weight" and not embedding):
                    continue
                tensor = f.get_tensor(hf_name)     # copy_ casts it to the model's dtype and device
                if len(parts) >= 2 and parts[-2] in fused:
                    fused_name, first = fused[parts[-2]]
                    put(".".join(parts[:-2] + [fused_name, parts[-1]]), tensor, first)
                    continue
                put(name, tensor)
                if name == "embed_tokens.weight" and cfg.tie_embeddings and linear_weights:
                    put("lm_head.weight", tensor)
    missing = [n for n, p in params.items() if filled[n] != p.shape[1 if n.endswith("weight_t") else 0]
               and (linear_weights or not n.endswith("weight_t")) and (embedding or n != "embed_tokens.weight")]
    if missing:
        raise ValueError(f"{folder}: weights missing or incomplete for {missing[:5]}")
    return model.eval().requires_grad_(False)
