"""The GGUF blocks' matmul in Triton; same signature as gguf_quant.py's `gguf_matmul`.

A decode step's matmul is bound by reading the weights, and the blocks are the fewest bytes that
hold them (Q4_K: 4.5 bits a weight against bf16's 16), so each program reads a tile of outputs'
blocks as stored, dequantizes them in registers (the formulas of gguf_quant.py, per weight from
its block's bytes) and multiplies: one block of the type (32 or 256 weights) per step of K.
Above a few rows the engine dequantizes to bf16 once instead (engine/quantize.py), where a dense
GEMM computes faster than the decode of blocks repeated per tile.
"""
import torch
import triton
import triton.language as tl

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
def _dequant(b, k, TYPE: tl.constexpr):
    """Weights k (0..block-1, [1, KT]) of the blocks at byte pointers b ([BLOCK_N, 1]) -> float32."""
    if TYPE == 0:                                           # Q8_0
        q = tl.load(b + 2 + k).to(tl.int8, bitcast=True).to(tl.float32)
        return _f16(b) * q
    elif TYPE == 1:                                         # Q5_0
        high = (_byte(b + 2 + k // 8) >> (k % 8)) & 1
        low = (_byte(b + 6 + k % 16) >> (4 * (k // 16))) & 0xF
        return _f16(b) * ((low | (high << 4)) - 16).to(tl.float32)
    elif TYPE == 2:                                         # Q4_1
        q = (_byte(b + 4 + k % 16) >> (4 * (k // 16))) & 0xF
        return _f16(b) * q.to(tl.float32) + _f16(b + 2)
    elif TYPE == 3:                                         # Q4_K: 8 units of 32, 6-bit scales and mins
        j = k // 32
        q = (_byte(b + 16 + 32 * (j // 2) + k % 32) >> (4 * (j % 2))) & 0xF
        s = b + 4
        first = j < 4
        sc = tl.where(first, _byte(s + j % 4) & 63,
                      (_byte(s + 8 + j % 4) & 0xF) | ((_byte(s + j % 4) >> 6) << 4))
        mn = tl.where(first, _byte(s + 4 + j % 4) & 63,
                      (_byte(s + 8 + j % 4) >> 4) | ((_byte(s + 4 + j % 4) >> 6) << 4))
        return (_f16(b) * sc.to(tl.float32)) * q.to(tl.float32) - _f16(b + 2) * mn.to(tl.float32)
    else:                                                   # Q6_K: 16 units of 16, int8 scales
        h = k // 128
        g = (k % 128) // 32
        c = k % 32
        low = (_byte(b + 64 * h + 32 * (g % 2) + c) >> (4 * (g // 2))) & 0xF
        high = (_byte(b + 128 + 32 * h + c) >> (2 * g)) & 3
        sc = tl.load(b + 192 + k // 16).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16(b + 208) * sc) * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _gguf_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om,
                 TYPE: tl.constexpr, BLOCK: tl.constexpr, NBYTES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK)
    n_mask = rn[:, None] < N
    rows = w_ptr + tl.where(n_mask, rn[:, None], 0).to(tl.int64) * row_bytes     # masked rows read row 0
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for b in range(0, K // BLOCK):
        w = _dequant(rows + b * NBYTES, rk[None, :], TYPE)                        # [BLOCK_N, BLOCK]
        k = b * BLOCK + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=rm[:, None] < M, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gguf_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, block_n: int = 32, num_warps: int = 4) -> torch.Tensor:
    t = TYPES[qtype]
    assert w.is_contiguous() and w.dtype == torch.uint8, "GGUF blocks: contiguous uint8 [N, row_bytes]"
    x = x if x.stride(-1) == 1 else x.contiguous()
    (M, K), N = x.shape, w.shape[0]
    assert K % t.block == 0 and w.shape[1] == K // t.block * t.nbytes
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, 16))
    _gguf_kernel[grid](x, w, out, M, N, K, w.shape[1], x.stride(0), out.stride(0), TYPE=t.id, BLOCK=t.block,
                       NBYTES=t.nbytes, BLOCK_M=16, BLOCK_N=block_n, num_warps=num_warps)
    return out
