"""RMSNorm with the residual add, and rotary embedding, in Triton; same signatures as the
references in norm_rope.py. One program per row (token): both are memory-bound, and fusing
them saves a round trip through memory per elementwise step."""
import torch
import triton
import triton.language as tl


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
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < heads) & (i[None, :] < HALF)
    c = tl.load(cos_ptr + t * stride_ct + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (t * heads + h[:, None]) * (2 * HALF) + i[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_warps: int = 4) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, heads, dh = x.shape
    cos, sin = cos.reshape(T, -1), sin.reshape(T, -1)
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    out = torch.empty(T, heads, dh, dtype=x.dtype, device=x.device)
    _rotary_kernel[(T,)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                         HALF=dh // 2, BLOCK_H=triton.next_power_of_2(heads),
                         BLOCK_HALF=triton.next_power_of_2(dh // 2), num_warps=num_warps)
    return out
