"""The GGUF blocks' matmul in Triton; same signature as gguf_quant.py's `gguf_matmul`.

A decode step's matmul is bound by reading the weights, and the blocks are the fewest bytes that
hold them (Q4_K: 4.5 bits a weight against bf16's 16), so each program reads a tile of outputs'
blocks as stored, dequantizes them in registers (the formulas of gguf_quant.py) and multiplies.
A block is taken 32 weights at a time: their bytes are 16-32 contiguous ones of each row, and
their scales one or two values per row, loaded once for the 32 (the first form of this kernel
decoded every weight from gathered bytes, scales included, and read the 1.5B's Q4_K gate|up at
93 GB/s on an H200, where bf16 reads 3.5 TB/s). The grid is the bf16 GEMV's (gemv_triton.plan):
columns of outputs, then slices of K whose float32 partial sums a second launch adds in order,
so that a short, wide layer (the MLP's down projection) still fills the chip.
Above a few rows the engine dequantizes to bf16 once instead (engine/quantize.py), where a dense
GEMM computes faster than the decode of blocks repeated per tile.
"""
import torch
import triton
import triton.language as tl

from kernels.gemv_triton import Launch
from kernels.gguf_quant import TYPES


@triton.jit
def _f16(p):
    """Two little-endian bytes at p -> float32."""
    lo = tl.load(p).to(tl.uint16)
    hi = tl.load(p + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _chunk(b, c, U: tl.constexpr, TYPE: tl.constexpr):
    """Weights 32 U + c (c = 0..31, [1, 32]) of the blocks at byte pointers b ([BLOCK_N, 1]) -> float32."""
    if TYPE == 0:                                           # Q8_0
        return _f16(b) * tl.load(b + 2 + c).to(tl.int8, bitcast=True).to(tl.float32)
    elif TYPE == 1:                                         # Q5_0: the fifth bits in one uint32
        qh = _byte(b + 2) | (_byte(b + 3) << 8) | (_byte(b + 4) << 16) | (_byte(b + 5) << 24)
        low = (_byte(b + 6 + c % 16) >> (4 * (c // 16))) & 0xF
        return _f16(b) * ((low | (((qh >> c) & 1) << 4)) - 16).to(tl.float32)
    elif TYPE == 2:                                         # Q4_1
        q = (_byte(b + 4 + c % 16) >> (4 * (c // 16))) & 0xF
        return _f16(b) * q.to(tl.float32) + _f16(b + 2)
    elif TYPE == 3:                                         # Q4_K: unit U of 8, 6-bit scale and min
        q = (_byte(b + 16 + 32 * (U // 2) + c) >> (4 * (U % 2))) & 0xF
        s = b + 4
        if U < 4:
            sc = _byte(s + U) & 63
            mn = _byte(s + 4 + U) & 63
        else:
            sc = (_byte(s + 8 + U % 4) & 0xF) | ((_byte(s + U % 4) >> 6) << 4)
            mn = (_byte(s + 8 + U % 4) >> 4) | ((_byte(s + 4 + U % 4) >> 6) << 4)
        return (_f16(b) * sc.to(tl.float32)) * q.to(tl.float32) - _f16(b + 2) * mn.to(tl.float32)
    else:                                                   # Q6_K: two units of 16, int8 scales
        h: tl.constexpr = U // 4
        g: tl.constexpr = U % 4
        low = (_byte(b + 64 * h + 32 * (g % 2) + c) >> (4 * (g // 2))) & 0xF
        high = (_byte(b + 128 + 32 * h + c) >> (2 * g)) & 3
        s0 = tl.load(b + 192 + 2 * U).to(tl.int8, bitcast=True).to(tl.float32)
        s1 = tl.load(b + 193 + 2 * U).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16(b + 208) * tl.where(c < 16, s0, s1)) * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _gguf_kernel(x_ptr, w_ptr, out_ptr, M, N, K, blocks_per_split, row_bytes, stride_xm, stride_om,
                 TYPE: tl.constexpr, BLOCK: tl.constexpr, NBYTES: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(2) * blocks_per_split
    c = tl.arange(0, 32)[None, :]
    n_mask = rn[:, None] < N
    m_mask = rm[:, None] < M
    rows = w_ptr + tl.where(n_mask, rn[:, None], 0).to(tl.int64) * row_bytes     # masked rows read row 0
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for blk in range(first, tl.minimum(first + blocks_per_split, K // BLOCK)):
        b = rows + blk * NBYTES
        for u in tl.static_range(BLOCK // 32):
            w = _chunk(b, c, u, TYPE)                                             # [BLOCK_N, 32]
            x = tl.load(x_ptr + rm[:, None] * stride_xm + blk * BLOCK + 32 * u + c, mask=m_mask, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    mask = m_mask & (rn[None, :] < N)
    if SPLIT:   # a float32 partial sum, which _gemv_reduce_kernel adds up
        tl.store(out_ptr + (tl.program_id(2) * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gguf_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, block_n: int | None = None,
                splits: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """`block_n` (outputs per program) and `splits` (slices of K, in whole blocks): None, as the
    GEMV's `plan` sizes them for this chip."""
    t = TYPES[qtype]
    assert t.id <= 4, f"{qtype} is a CPU kernel's layout; the GPU reads the file's types"
    assert w.is_contiguous() and w.dtype == torch.uint8, "GGUF blocks: contiguous uint8 [N, row_bytes]"
    x = x if x.stride(-1) == 1 else x.contiguous()
    (M, K), N = x.shape, w.shape[0]
    assert K % t.block == 0 and w.shape[1] == K // t.block * t.nbytes
    if M == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    run = Launch.of(x, N, t.block, block_n, splits)
    _gguf_kernel[run.grid](x, w, run.dest, M, N, K, run.k_per_split // t.block, w.shape[1], x.stride(0),
                           run.out.stride(0), TYPE=t.id, BLOCK=t.block, NBYTES=t.nbytes, SPLIT=run.splits > 1,
                           BLOCK_M=run.block_m, BLOCK_N=run.block_n, num_warps=num_warps)
    return run.finish(None, num_warps)
