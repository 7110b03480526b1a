"""A dense Linear over a few rows (a decode batch) in Triton; same signature as gemv.py's twin.

At one to a few dozen rows a Linear is bound by reading its weight, and cuBLAS spends a fixed
few microseconds on the small projections (q|k|v, o) whatever their size (issue 53's profile:
2.5-3x their bytes' worth on an H100). Here the grid is sized to fill the chip: each program
reads a [k-slice, BLOCK_N] tile column of weight_t [K, N] (N contiguous, as the engine stores it),
narrower columns first, then (a short, wide layer leaves SMs idle) slices of K whose float32
partial sums a second launch adds in order, with the bias, before one rounding. No atomics: the
same inputs give the same bits at every run.

bf16 in, bf16 out on CUDA. float32 runs too (the tests, under the interpreter), but on a GPU its
tl.dot rounds the operands to TF32. The weight may also be int8 or float8 e4m3 with a float32 scale
per output (`scales`): each tile is widened to x's dtype in registers (exactly: bf16 holds every
int8 and e4m3 value) and the scale taken after the sum, so a quantized layer reads its own bytes,
half of bf16's, at the GEMV's pace.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wk, stride_om,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per column of outputs, tile of rows and slice of K (k_per_split, whole
    # BLOCK_Ks). Rows below 16 are masked: tl.dot takes 16, and the weight read is the cost.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = tl.program_id(2) * k_per_split
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm[:, None] < M, rn[None, :] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(lo, tl.minimum(lo + k_per_split, K), BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_mask & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + k[:, None].to(tl.int64) * stride_wk + rn[None, :], mask=(k[:, None] < K) & n_mask,
                    other=0.0)
        acc += tl.dot(x, w.to(x.dtype))
    if HAS_SCALE:   # a slice's partial sum takes it too: the sum of scaled parts is the scaled sum
        acc *= tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if SPLIT:   # a float32 partial sum, which _gemv_reduce_kernel adds up
        tl.store(out_ptr + (tl.program_id(2) * M + rm[:, None]) * N + rn[None, :], acc, mask=m_mask & n_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask & n_mask)


@triton.jit
def _gemv_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                        SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    m, n = i // N, i % N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):       # in order: the sum is the same at every run
        acc += tl.load(part_ptr + s * M * N + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def programs_to_fill(device: torch.device) -> int:
    """Programs that keep every SM busy: two per SM (a few under the CPU's interpreter)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def plan(M: int, N: int, K: int, fill: int, block_k: int = 128, block_m: int | None = None,
         block_n: int | None = None) -> tuple[int, int, int]:
    """(block_m, block_n, splits) for an [M, K] x [K, N] product on a chip that `fill` programs
    keep busy: columns of 64 outputs, or 32 (64 bytes of bf16 a row, still whole memory sectors)
    where 64 leave SMs idle; then K in as many slices of whole BLOCK_Ks as it takes to fill.
    `block_m`, `block_n`: a kernel's own tile, where it has one."""
    block_m = block_m or min(64, max(16, triton.next_power_of_2(M)))
    block_n = block_n or (64 if triton.cdiv(N, 64) * triton.cdiv(M, block_m) >= fill else 32)
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    return block_m, block_n, _slices(K, max(1, min(triton.cdiv(fill, tiles), triton.cdiv(K, block_k))), block_k)[0]


def _slices(K: int, splits: int, block_k: int) -> tuple[int, int]:
    """(slices, their length): K in about `splits` slices of whole BLOCK_Ks."""
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


@dataclass
class Launch:
    """One product's grid as `plan` sizes it (or as asked): where its programs write (`dest`: the
    output, or float32 partial sums per slice of K) and the output the slices sum into."""
    out: torch.Tensor
    dest: torch.Tensor
    grid: tuple[int, int, int]
    block_m: int
    block_n: int
    splits: int
    k_per_split: int

    @classmethod
    def of(cls, x: torch.Tensor, N: int, block_k: int, block_n: int | None = None,
           splits: int | None = None, block_m: int | None = None) -> Launch:
        (M, K) = x.shape
        block_m, block_n, planned_splits = plan(M, N, K, programs_to_fill(x.device), block_k, block_m, block_n)
        splits, k_per_split = _slices(K, splits or planned_splits, block_k)
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
        dest = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
        return cls(out, dest, (triton.cdiv(N, block_n), triton.cdiv(M, block_m), splits), block_m, block_n,
                   splits, k_per_split)

    def finish(self, bias: torch.Tensor | None, num_warps: int) -> torch.Tensor:
        """The output, the slices' partial sums added in order first (with the bias) where K was cut."""
        if self.splits > 1:
            M, N = self.out.shape
            _gemv_reduce_kernel[(triton.cdiv(M * N, 1024),)](self.dest, self.dest if bias is None else bias, self.out,
                                                             M, N, self.out.stride(0), HAS_BIAS=bias is not None,
                                                             SPLITS=self.splits, BLOCK=1024, num_warps=num_warps)
        return self.out


def gemv_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None,
                scales: torch.Tensor | None = None, splits: int | None = None, block_n: int | None = None,
                block_k: int = 128, num_warps: int = 4) -> torch.Tensor:
    """`scales` float32 [N] for an int8 or e4m3 weight_t; `splits` (slices of K, summed by a
    second launch) and `block_n`: None, as `plan` sizes them for this chip."""
    assert x.dim() == 2 and weight_t.stride(1) == 1, "x [M, K] and weight_t [K, N] with N contiguous"
    x = x if x.stride(1) == 1 else x.contiguous()
    (M, K), N = x.shape, weight_t.shape[1]
    if M == 0:      # an empty grid is no launch
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    run = Launch.of(x, N, block_k, block_n, splits)
    _gemv_kernel[run.grid](x, weight_t, x if scales is None else scales, x if bias is None else bias, run.dest,
                           M, N, K, run.k_per_split, x.stride(0), weight_t.stride(0), run.out.stride(0),
                           HAS_SCALE=scales is not None, HAS_BIAS=bias is not None, SPLIT=run.splits > 1,
                           BLOCK_M=run.block_m, BLOCK_N=run.block_n, BLOCK_K=block_k, num_warps=num_warps)
    return run.finish(bias, num_warps)
