"""Weight-only quantized matmuls in Triton; same signatures as the references in quant_matmul.py.

The weight is read once, dequantized in registers and multiplied, so memory traffic is the
int8/int4 weight itself: that is the whole win at small M, where a matmul is bandwidth-bound.
Each program reads whole rows of the weight (K contiguous, as stored), and the grid is sized so
that a decode step's GEMV spreads over the whole chip rather than a few dozen programs: narrower
tiles first, then (int8, a long K) slices of K summed by a second launch.
"""

import torch
import triton
import triton.language as tl

from kernels.gemv_triton import programs_to_fill


@triton.jit
def _int8_kernel(x_ptr, w_ptr, scales_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    # One program per tile of outputs and slice of K (k_per_split, whole BLOCK_Ks). Rows of M
    # below 16 are masked: tl.dot needs 16, and the weight read is the cost either way (on an
    # H100 the tiles read a decode step's large layers faster than a multiply-add GEMV did).
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = tl.program_id(2) * k_per_split
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(lo, tl.minimum(lo + k_per_split, K), BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K),
                    other=0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))           # int8 -> bf16/fp32 is exact
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:   # a float32 partial sum, which _int8_reduce_kernel adds up and scales
        tl.store(out_ptr + (tl.program_id(2) * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
    else:
        # The per-output-channel scale is constant along k, so it is applied once, after the sum.
        acc *= tl.load(scales_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_reduce_kernel(part_ptr, scales_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):       # in order: the sum is the same at every run
        acc += tl.load(part_ptr + s * M * N + i, mask=mask, other=0.0)
    m, n = i // N, i % N
    acc *= tl.load(scales_ptr + n, mask=mask, other=0.0)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
        j_mask = m_mask & (j[None, :] < K // 2)
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * j[None, :], mask=j_mask, other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * j[None, :] + 1, mask=j_mask, other=0.0)
        acc += tl.dot(x_even, lo)
        acc += tl.dot(x_odd, hi)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask & n_mask)


def _prepare(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert w.is_contiguous(), "quantized weights must be contiguous"
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, splits: int | None = None,
                num_warps: int = 4) -> torch.Tensor:
    """`splits`: how many slices of K run in parallel (None: as many as it takes to fill the
    chip, for a long K only); more than one adds a launch that sums the slices in order."""
    x, out = _prepare(x, w)
    (M, K), N = x.shape, w.shape[0]
    block_m, block_n, block_k = min(64, max(16, triton.next_power_of_2(M))), 64, 128
    fill = programs_to_fill(x.device)
    while block_n > 16 and triton.cdiv(N, block_n) * triton.cdiv(M, block_m) < fill:
        block_n //= 2
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    if splits is None:      # a tall layer (the MLP's down projection) still leaves SMs idle
        splits = max(1, min(triton.cdiv(fill, tiles), K // 1024))
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_per_split)
    dest = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), splits)
    _int8_kernel[grid](x, w, scales, dest, M, N, K, k_per_split, x.stride(0), out.stride(0),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=splits > 1, num_warps=num_warps)
    if splits > 1:
        _int8_reduce_kernel[(triton.cdiv(M * N, 1024),)](dest, scales, out, M, N, out.stride(0),
                                                          SPLITS=splits, BLOCK=1024, num_warps=num_warps)
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


@triton.jit
def _e4m3_bits(v):
    """float32 v, |v| <= 448 or NaN -> its float8 e4m3fn bits (uint8), rounded to nearest even as
    torch's conversion rounds. Written out in integer steps: the interpreter's own float8 cast
    truncates (125.4 came out 64), so the tests could not check a plain cast against the twin."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = ((bits >> 31) << 7).to(tl.int32)
    a = tl.abs(v)
    # Normal e4m3 (from 2**-6): the exponent rebiased, the mantissa's top 3 bits rounded.
    mag = a.to(tl.uint32, bitcast=True)
    keep = ((mag >> 20) & 7).to(tl.int32)
    rest = (mag & 0xFFFFF).to(tl.int32)
    up = ((rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))).to(tl.int32)
    normal = (((mag >> 23).to(tl.int32) - 120) << 3) + keep + up       # a carry into the exponent is right
    # Subnormal (below 2**-6): steps of 2**-9, the step count its bits (8 is the least normal, 0x08).
    t = tl.where(a < 0.015625, a * 512.0, 0.0)      # (and no NaN cast to an integer)
    whole = tl.floor(t)
    frac = t - whole
    n = whole.to(tl.int32)
    sub = n + ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    out = tl.where(a < 0.015625, sub, normal)
    out = tl.where(v != v, 0x7F, out)                                    # NaN
    return (out | sign).to(tl.uint8)


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, BLOCK: tl.constexpr):
    # One program per row: its largest magnitude, then every value over the row's scale.
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, 0)
    scale = tl.where(top > 0, top * (1.0 / 448.0), 1.0)     # the twin's product, not a quotient
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)
        r = tl.math.div_rn(x, scale)
        q = tl.where(r != r, r, tl.clamp(r, -448.0, 448.0))     # a NaN stays one, as the twin's clamp keeps it
        tl.store(q_ptr + row * K + k0 + k, _e4m3_bits(q), mask=k0 + k < K)
    tl.store(scale_ptr + row, scale)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_matmul.quantize_fp8 in one launch rather than its eight tensor operations (with them
    an fp8 layer took 21-37 µs on an H200, bf16's 4-17): the same scales and e4m3 values."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        _fp8_rows_kernel[(M,)](x, q, scale, K, x.stride(0), BLOCK=min(1024, triton.next_power_of_2(K)))
    return q.view(torch.float8_e4m3fn), scale
