"""RMSNorm with the residual add, and rotary embedding with the KV cache write it precedes, in
Triton; same signatures as the references in norm_rope.py. One program per row (token): both
are memory-bound, and fusing them saves a round trip through memory per elementwise step, and
at decode's batch sizes a launch per fused step."""
import torch
import triton
import triton.language as tl

from kernels.attention_triton import _check_cache, _last_dim_contiguous


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, eps, D,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * D
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    h = tl.load(x_ptr + row + d, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Summed in fp32 and rounded once to x's dtype, as torch adds bf16; the norm then
        # reads the rounded sum, as the reference does.
        h = (h.to(tl.float32) + tl.load(res_ptr + row + d, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(new_res_ptr + row + d, h, mask=mask)
    hf = h.to(tl.float32)
    normed = hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0)
    out = normed.to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row + d, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(x):
    """Rows of x -> int8 and their scales, exactly as attention.quantize_kv."""
    scale = tl.max(tl.abs(x), axis=1) / 127
    q = x / tl.where(scale > 0, scale, 1.0)[:, None]
    q = q + tl.where(q >= 0, 0.5, -0.5)   # then truncation rounds half away from zero
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8), scale


@triton.jit
def _write_kv(k, v, k_cache, v_cache, k_scale, v_scale, slot, h, d, mask,
              KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """One token's keys and values [heads, head_dim] into its cache slot, quantized when int8."""
    dst = slot * KV_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :]
    if QUANT:
        k, ks = _quantize(k.to(tl.float32))
        v, vs = _quantize(v.to(tl.float32))
        tl.store(k_scale + slot * KV_HEADS + h, ks, mask=h < KV_HEADS)
        tl.store(v_scale + slot * KV_HEADS + h, vs, mask=h < KV_HEADS)
    tl.store(k_cache + dst, k, mask=mask)
    tl.store(v_cache + dst, v, mask=mask)


@triton.jit
def _rotate(x_ptr, stride_h, h, d, c, s, mask, HALF: tl.constexpr):
    """Rows h of x (one every stride_h) rotated and rounded to x's dtype, as the reference
    returns them: whole rows [BLOCK_H, BLOCK_D], not halves, for int8 quantization's absmax."""
    first = d < HALF
    src = x_ptr + h[:, None] * stride_h
    x = tl.load(src + d[None, :], mask=mask, other=0.0)
    partner = tl.load(src + tl.where(first, d + HALF, d - HALF)[None, :], mask=mask, other=0.0).to(tl.float32)
    # x1*c + (-x2)*s rounds exactly as the reference's x1*c - x2*s.
    return (x.to(tl.float32) * c + tl.where(first[None, :], -partner, partner) * s).to(x.dtype)


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out, k_cache, v_cache, k_scale, v_scale,
                            slot_mapping, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_ct, stride_st,
                            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr,
                            QUANT: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    half = tl.where(d < HEAD_DIM // 2, d, d - HEAD_DIM // 2)
    c = tl.load(cos_ptr + t * stride_ct + half, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + half, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < HEADS) & d_mask[None, :]
    q = _rotate(q_ptr + t * stride_qt, stride_qh, h, d, c, s, mask, HEAD_DIM // 2)
    tl.store(q_out + (t * HEADS + h[:, None]) * HEAD_DIM + d[None, :], q, mask=mask)

    h = tl.arange(0, BLOCK_KVH)
    mask = (h[:, None] < KV_HEADS) & d_mask[None, :]
    k = _rotate(k_ptr + t * stride_kt, stride_kh, h, d, c, s, mask, HEAD_DIM // 2)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    _write_kv(k, v, k_cache, v_cache, k_scale, v_scale, slot, h, d, mask, KV_HEADS, HEAD_DIM, QUANT)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    D = x.shape[-1]
    out = torch.empty_like(x)
    new_res = x if residual is None else torch.empty_like(x)
    _add_rms_norm_kernel[(x.numel() // D,)](x, None if residual is None else residual.contiguous(), weight, out,
                                            new_res, eps, D, HAS_RESIDUAL=residual is not None,
                                            BLOCK_D=triton.next_power_of_2(D), num_warps=num_warps)
    return out, new_res


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    num_warps: int = 4) -> torch.Tensor:
    """One launch for what the reference does in three (rotary on q, rotary on k, store_kv):
    one program per token takes all its query and KV heads."""
    quant = _check_cache(k_cache, v_cache, k_scale, v_scale)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    T, heads, dh = q.shape
    kvh = k.shape[1]
    cos, sin = cos.reshape(T, -1), sin.reshape(T, -1)
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    out = torch.empty(T, heads, dh, dtype=q.dtype, device=q.device)
    # No fused multiply-adds: the reference rounds each product, and an FMA that rounds once
    # would now and then move a bf16 key by an ulp and its int8 value with it.
    _rotary_store_kv_kernel[(T,)](q, k, v, cos, sin, out, k_cache, v_cache, k_scale, v_scale, slot_mapping,
                                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                  cos.stride(0), sin.stride(0),
                                  HEADS=heads, KV_HEADS=kvh, HEAD_DIM=dh, BLOCK_H=triton.next_power_of_2(heads),
                                  BLOCK_KVH=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(dh),
                                  QUANT=quant, num_warps=num_warps, enable_fp_fusion=False)
    return out
