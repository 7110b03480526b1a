"""RMSNorm with the residual add, and rotary embedding with the KV cache write it precedes,
plain PyTorch: the reference twins of norm_rope_triton.py (`apply_rotary` is a part of the
second, as `attention.store_kv` is)."""
import torch
import torch.nn.functional as F

from kernels.attention import quantize_kv, store_kv


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) over the last dim; residual None adds nothing.

    As in Hugging Face: the sum is taken in x's dtype, the norm in fp32, and the normed value is
    cast back to x's dtype before the weight multiplies it.
    """
    h = x if residual is None else x + residual
    normed = F.rms_norm(h.float(), h.shape[-1:], eps=eps)   # one fused op; equal to HF's pow/mean/rsqrt
    return (weight * normed.to(h.dtype)).to(h.dtype), h


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, head_dim / 2] (or [T, 1, head_dim / 2]).

    Hugging Face's non-interleaved layout: the rotated pairs are (x[i], x[i + head_dim / 2]).
    """
    cos, sin = cos.reshape(x.shape[0], 1, -1), sin.reshape(x.shape[0], 1, -1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary on q [T, heads, head_dim] and k [T, kv_heads, head_dim], the rotated k and v
    written into their slots as attention.store_kv does; returns the rotated q."""
    # q and k rotated as one tensor: half the operator calls, which is most of their cost at decode.
    q, k = apply_rotary(torch.cat((q, k), 1), cos, sin).split([q.shape[1], k.shape[1]], 1)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def rotate_keys(k_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_scale: torch.Tensor | None = None) -> None:
    """Write into blocks `dst` the keys of blocks `src` rotated by one angle per frequency (cos,
    sin [head_dim / 2]; apply_rotary's layout), computed in float32. RoPE composes, so a key
    stored for position p and rotated by d is the key for p + d: a KV window's sinks moved up
    to the recent tokens (llama.cpp's context shift moves the others back instead). An int8
    cache is dequantized, rotated and quantized again: up to half a scale step per value.
    Plain tensor operations on any device, a few per layer for a block or two per dropped
    block, so no Triton twin is needed."""
    k = k_cache.index_select(0, src).float()                        # [n, block_size, kv_heads, head_dim]
    if k_scale is not None:
        k = k * k_scale.index_select(0, src)[..., None]
    x1, x2 = k.chunk(2, dim=-1)
    k = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if k_scale is None:
        k_cache.index_copy_(0, dst, k.to(k_cache.dtype))
        return
    q, scale = quantize_kv(k.flatten(0, 1))
    k_cache.index_copy_(0, dst, q.view(k.shape))
    k_scale.index_copy_(0, dst, scale.view(k.shape[:-1]))
