"""Weight-only quantized matmuls in Triton, for the decode GEMV (M = a few tokens); same
signatures as the references in quant_matmul.py.

The weight is read once, dequantized in registers and multiplied, so memory traffic is the
int8/int4 weight itself: that is the whole win at small M, where a GEMV is bandwidth-bound.
M is padded to 16 rows because tl.dot needs every dimension >= 16.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _int8_kernel(x_ptr, w_ptr, scales_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0)
        acc += tl.dot(x, w.to(x.dtype))                     # int8 -> bf16/fp32 is exact
    # The per-output-channel scale is constant along k, so it is applied once, after the sum.
    acc *= tl.load(scales_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _int4_kernel(x_ptr, w_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Each packed byte j holds k = 2j (low nibble) and k = 2j + 1 (high nibble): instead of
    # interleaving the nibbles, x's even and odd columns are multiplied by them separately.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rj = tl.arange(0, BLOCK_K // 2)
    m_mask = rm[:, None] < M
    n_mask = rn[None, :] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j0 in range(0, K // 2, BLOCK_K // 2):
        j = j0 + rj
        j_mask = j[:, None] < K // 2
        packed = tl.load(w_ptr + rn[None, :].to(tl.int64) * (K // 2) + j[:, None], mask=n_mask & j_mask, other=0)
        # Both nibbles of a byte fall in one group, since groups have even size.
        g_off = rn[None, :] * (K // GROUP) + (2 * j[:, None]) // GROUP
        scale = tl.load(scales_ptr + g_off, mask=n_mask & j_mask, other=0.0)
        zero = tl.load(zeros_ptr + g_off, mask=n_mask & j_mask, other=0.0)
        lo = (((packed & 0xF).to(tl.float32) - zero) * scale).to(x_ptr.dtype.element_ty)   # [BLOCK_K/2, BLOCK_N]
        hi = (((packed >> 4).to(tl.float32) - zero) * scale).to(x_ptr.dtype.element_ty)
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * j[None, :], mask=m_mask & (j[None, :] < K // 2), other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * j[None, :] + 1, mask=m_mask & (j[None, :] < K // 2), other=0.0)
        acc += tl.dot(x_even, lo)
        acc += tl.dot(x_odd, hi)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask & n_mask)


def _prepare(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert w.is_contiguous(), "quantized weights must be contiguous"
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                block_n: int = 64, block_k: int = 128, num_warps: int = 4) -> torch.Tensor:
    x, out = _prepare(x, w)
    (M, K), N = x.shape, w.shape[0]
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, 16))
    _int8_kernel[grid](x, w, scales, out, M, N, K, x.stride(0), out.stride(0),
                       BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out


def int4_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                block_n: int = 64, block_k: int = 128, num_warps: int = 4) -> torch.Tensor:
    assert scales.is_contiguous() and zeros.is_contiguous()
    x, out = _prepare(x, w)
    (M, K), N = x.shape, w.shape[0]
    assert K % group_size == 0 and group_size % 2 == 0
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, 16))
    _int4_kernel[grid](x, w, scales, zeros, out, M, N, K, x.stride(0), out.stride(0),
                       GROUP=group_size, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out
