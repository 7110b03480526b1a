"""The GGUF blocks' matmul in Triton; same signature as gguf_quant.py's `gguf_matmul`.

A decode step's matmul is bound by reading the weights, and the blocks are the fewest bytes that
hold them (Q4_K: 4.5 bits a weight against bf16's 16), so each program reads a tile of outputs'
blocks as stored and multiplies them in registers. Once the bytes are read, what costs is the
work per weight, so a weight takes none that can be done per unit of 16 or 32 instead:
- its small unsigned integer t becomes a bfloat16 by an OR of 0x4300 (128.0) into its bits,
  128 + t exactly, two at a time in a 32-bit word where the bytes allow (`_nibbles`, `_spread`),
  with no integer-to-float conversion;
- the tensor cores sum a unit's products with x exactly (integers below 256 and bf16 x, in
  float32), and the unit's scale s and offset o (w = s (t - z) + o, z the type's zero point)
  apply to the sum once: s * sum(x t) + (o - s (128 + z)) * sum(x), x's sum from the tensor
  cores too; a type with no offset (Q6_K, Q5_0) takes 128 + z off t in bfloat16 instead,
  exactly and two weights an instruction, and needs no sum of x;
- the weights are the product's rows and x its columns, so one row of x pads to the tensor
  cores' 8 columns rather than to 16 rows of x.
The previous form of this kernel dequantized every weight to float32, its unit's scale and
offset applied, before a product: compiled for sm_90 it issued 112 SM-cycles of instructions per
KB of Q4_K and 163 of Q6_K, where an H200's memory delivers a KB in 56
(benchmarks/gguf_sass.py), and it read the 1.5B's Q4_K layers from an H200's memory at 0.2-0.6
TB/s; this one issues 63, and 60 on Q6_K in the GPU's layout of it: Q6_K, Q8_0 and Q5_0 come in
planes (gguf_quant.to_planes), each block's integers 16-byte aligned (Q5_0: 4) where the file
leaves them 2-byte aligned, so that they arrive in asynchronous copies issued a pipeline stage
ahead.
The grid is the bf16 GEMV's (gemv_triton.plan): columns of outputs, then slices of K whose
float32 partial sums a second launch adds in order, so that a short, wide layer (the MLP's down
projection) still fills the chip.
Above a few rows the engine dequantizes to bf16 once instead (engine/quantize.py), where a dense
GEMM computes faster than the decode of blocks repeated per tile.
"""
import torch
import triton
import triton.language as tl

from kernels.gemv_triton import Launch
from kernels.gguf_quant import INTS, PLANAR, TYPES, row_bytes


@triton.jit
def _f16(p):
    """float16 at 2-byte aligned byte pointers p -> float32."""
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _t(v):
    """Small unsigned integers (< 128, any integer dtype) -> 128 + v in bfloat16, exactly."""
    return (v.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)


@triton.jit
def _nibbles(words, shift: tl.constexpr):
    """int32 words [N, 8] -> 128 + their bytes' nibbles at `shift` (0 or 4), [N, 32] bfloat16 in
    the order of `nibble_order`: a word's bytes 0 and 2 (1 and 3) are masked into its two halves
    together, and the halves joined as they stand; x is loaded in their order, which costs less
    than joining them back into the bytes' order."""
    a = ((words >> shift) & 0x000F000F) | 0x43004300                     # bytes 0, 2
    b = ((words >> (shift + 8)) & 0x000F000F) | 0x43004300               # bytes 1, 3
    t = tl.join(tl.join(a.to(tl.int16), b.to(tl.int16)), tl.join((a >> 16).to(tl.int16), (b >> 16).to(tl.int16)))
    return tl.reshape(t, [words.shape[0], 4 * words.shape[1]]).to(tl.bfloat16, bitcast=True)


@triton.jit
def _spread(p):
    """16 bytes at 2-byte aligned byte pointers p [N, 1] -> int32 [N, 8]: bytes 2 i and 2 i + 1 in
    the low and high halves of word i (at bits 0 and 16), for `_halves`."""
    v = tl.load(p.to(tl.pointer_type(tl.uint16)) + tl.arange(0, 8)[None, :]).to(tl.int32)
    return v | ((v & 0xFF00) << 8)


@triton.jit
def _halves(v):
    """int32 [N, W] each holding two bfloat16 -> [N, 2 W] bfloat16, low half first."""
    t = tl.join(v.to(tl.int16), (v >> 16).to(tl.int16))
    return tl.reshape(t, [v.shape[0], 2 * v.shape[1]]).to(tl.bfloat16, bitcast=True)


@triton.jit
def _unit(acc, t, x_ptrs, x_mask, scale, offset, ZERO: tl.constexpr, HAS_SUM: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + w @ x.T [U, BLOCK_M] for a unit of U weights per row, w = scale
    (t - 128 - ZERO) + offset with t [BLOCK_N, U] 128 + the unit's unsigned integers (`_t`; Q8_0's
    int8 weights themselves, ZERO -128), scale and offset [BLOCK_N]. With no offset (no HAS_SUM),
    128 + ZERO is taken off t before the product, exactly, in bfloat16 two at a time: cheaper
    than x's sum."""
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    t = t.to(x.dtype)
    if HAS_SUM:
        acc += tl.dot(t, x) * scale[:, None]
        # x's sum over the unit, in every row: on the tensor cores and in the product's layout,
        # where a sum along x would take shuffles and a change of layout
        xsum = tl.dot(tl.full(t.shape, 1.0, x.dtype), x)
        acc += xsum * (offset - scale * (128.0 + ZERO))[:, None]
    else:
        if ZERO != -128:
            t -= 128.0 + ZERO
        acc += tl.dot(t, x) * scale[:, None]
    return acc


@triton.jit
def _block(acc, q, s, xb, x_mask, TYPE: tl.constexpr, IN_PLANES: tl.constexpr):
    """acc plus one block's products: q and s [BLOCK_N] byte pointers to each row's block's
    integers and scales (gguf_quant.INTS: in the file's block, or in a GPU layout's planes), xb
    [1, BLOCK_M] pointers to x's values at the block's first column."""
    c = tl.arange(0, 32)[None, :]
    h = tl.arange(0, 16)[None, :]
    r = q[:, None]
    xc = tl.arange(0, 32)[:, None]      # x's columns, down
    xh = tl.arange(0, 16)[:, None]
    nibble_order = xc // 4 * 4 + xc % 2 * 2 + xc // 2 % 2      # a word's bytes 0, 2, 1, 3
    if TYPE == 0:                                           # Q8_0: 32 int8; d
        acc = _unit(acc, tl.load(r + c).to(tl.int8, bitcast=True), xb + xc, x_mask, _f16(s), 0.0, -128, False)
    elif TYPE == 1:                                         # Q5_0: 32 fifth bits, 16 bytes of nibbles; d
        fifth = q.to(tl.pointer_type(tl.uint16))
        qh = (tl.load(fifth).to(tl.int32) | (tl.load(fifth + 1).to(tl.int32) << 16))[:, None]
        qs = _spread(r + 4)                                 # weights 2 i, 2 i + 1 (low nibbles), 16 on (high)
        i = tl.arange(0, 8)[None, :]
        for half in tl.static_range(2):
            if IN_PLANES:   # Q5_0g: word i's two fifth bits are bits i + 8 half and 16 + i + 8 half, to 4 and 20
                f = ((qh << 4) >> i if half == 0 else qh >> (i + 4)) & 0x00100010
            else:           # the file's: bits 2 i + 16 half and 2 i + 1 + 16 half
                f = qh >> (2 * i + 16 * half)
                f = ((f & 1) << 4) | ((f & 2) << 19)
            five = ((qs >> (4 * half)) & 0x000F000F) | f | 0x43004300
            acc = _unit(acc, _halves(five), xb + 16 * half + xh, x_mask, _f16(s), 0.0, 16, False)
    elif TYPE == 2:                                         # Q4_1: 16 bytes of nibbles; d, m
        d, m = _f16(s), _f16(s + 2)
        qs = tl.load(r + h)
        acc = _unit(acc, _t(qs & 0xF), xb + xh, x_mask, d, m, 0, True)
        acc = _unit(acc, _t(qs >> 4), xb + 16 + xh, x_mask, d, m, 0, True)
    elif TYPE == 3:                                         # Q4_K: 128 bytes of nibbles; d, dmin, 12 bytes of
        d, dmin = _f16(s), _f16(s + 2)                      # 6-bit scales and mins
        sw = (s + 4).to(tl.pointer_type(tl.int32))          # the 12 bytes of scales as 3 words
        s0, s1, s2 = tl.load(sw), tl.load(sw + 1), tl.load(sw + 2)
        for i in tl.static_range(4):                        # units 2 i and 2 i + 1: one run of 32 bytes
            words = tl.load((r + 32 * i).to(tl.pointer_type(tl.int32)) + tl.arange(0, 8)[None, :])
            for half in tl.static_range(2):
                u = 2 * i + half
                at = 8 * (u % 4)                            # the unit's byte in each word
                if u < 4:
                    sc = (s0 >> at) & 63
                    mn = (s1 >> at) & 63
                else:
                    sc = ((s2 >> at) & 0xF) | (((s0 >> at) >> 2) & 0x30)
                    mn = ((s2 >> (at + 4)) & 0xF) | (((s1 >> at) >> 2) & 0x30)
                t = _nibbles(words, 4 * half)
                acc = _unit(acc, t, xb + 32 * u + nibble_order, x_mask, d * sc.to(tl.float32),
                            -dmin * mn.to(tl.float32), 0, True)
    else:   # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs; 16 int8 scales (a unit of 16 each), d
        d = _f16(s + 16)
        for hh in tl.static_range(2):                       # halves of 128 weights
            for c16 in tl.static_range(2):                  # weights 16 c16 .. 16 c16 + 15 of each run of 32
                qh = _spread(r + 128 + 32 * hh + 16 * c16) << 4
                ql0 = _spread(r + 64 * hh + 16 * c16)
                ql1 = _spread(r + 64 * hh + 32 + 16 * c16)
                for g in tl.static_range(4):
                    u = 8 * hh + 2 * g + c16
                    low = (ql0 if g % 2 == 0 else ql1) >> (4 * (g // 2))
                    t = _halves((low & 0x000F000F) | ((qh >> (2 * g)) & 0x00300030) | 0x43004300)
                    sc = tl.load(s + u).to(tl.int8, bitcast=True).to(tl.float32)
                    acc = _unit(acc, t, xb + 128 * hh + 32 * g + 16 * c16 + xh, x_mask, d * sc, 0.0, 32, False)
    return acc


@triton.jit
def _gguf_kernel(x_ptr, w_ptr, out_ptr, M, N, K, blocks_per_split, row_bytes, stride_xm, stride_om,
                 TYPE: tl.constexpr, BLOCK: tl.constexpr, NBYTES: tl.constexpr, LO: tl.constexpr,
                 HI: tl.constexpr, IN_PLANES: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(2) * blocks_per_split
    rows = w_ptr + tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes     # masked rows read row 0
    scales = rows + (K // BLOCK) * (HI - LO)                # a GPU layout's plane of scales
    xs = x_ptr + rm[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)      # outputs down, x's rows across
    for blk in range(first, tl.minimum(first + blocks_per_split, K // BLOCK), GROUP):
        for j in tl.static_range(GROUP):
            if IN_PLANES:
                q, s = rows + (blk + j) * (HI - LO), scales + (blk + j) * (NBYTES - HI + LO)
            else:   # a block's integers in [LO, HI), its scales before or after them
                q, s = rows + (blk + j) * NBYTES + LO, rows + (blk + j) * NBYTES + (HI if LO == 0 else 0)
            acc = _block(acc, q, s, xs + (blk + j) * BLOCK, rm[None, :] < M, TYPE, IN_PLANES)
    mask = (rm[None, :] < M) & (rn[:, None] < N)
    if SPLIT:   # a float32 partial sum, which _gemv_reduce_kernel adds up
        tl.store(out_ptr + (tl.program_id(2) * M + rm[None, :]) * N + rn[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gguf_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, block_n: int = 64,
                splits: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """`block_n`: outputs per program; at 64, Q4_K's loop takes 40% fewer SM-cycles to issue per
    weight than at 32, compiled for sm_90 (benchmarks/gguf_sass.py, --block-n 32). `splits` (slices of K, in whole
    blocks): None, as the GEMV's `plan` sizes them for this chip. A program takes x's rows up to
    the next power of two (one at a decode of one sequence: the tensor cores' 8 columns padded,
    not 16 rows)."""
    file_type = PLANAR.get(qtype, qtype)
    assert file_type in INTS, f"{qtype} is a CPU kernel's layout; the GPU reads the file's types and its own layouts"
    t, (lo, hi) = TYPES[file_type], INTS[file_type]
    assert w.is_contiguous() and w.dtype == torch.uint8, "GGUF blocks: contiguous uint8 [N, row_bytes]"
    x = x if x.stride(-1) == 1 else x.contiguous()
    (M, K), N = x.shape, w.shape[0]
    assert K % t.block == 0 and w.shape[1] == row_bytes(qtype, K)
    if M == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    # Blocks of 32 four to a loop pass, where K allows, so that a pass's fixed work (the loop,
    # x's loads) is spread over more weights.
    group = 4 if t.block == 32 and K % 128 == 0 else 1
    run = Launch.of(x, N, t.block * group, block_n, splits, block_m=triton.next_power_of_2(M))
    _gguf_kernel[run.grid](x, w, run.dest, M, N, K, run.k_per_split // t.block, w.shape[1], x.stride(0),
                           run.out.stride(0), TYPE=t.id, BLOCK=t.block, NBYTES=t.nbytes, LO=lo, HI=hi,
                           IN_PLANES=qtype in PLANAR, GROUP=group, SPLIT=run.splits > 1,
                           BLOCK_M=run.block_m, BLOCK_N=run.block_n, num_warps=num_warps)
    return run.finish(None, num_warps)
