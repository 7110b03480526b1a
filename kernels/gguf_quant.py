"""GGUF's own quantized blocks, read as stored: the reference twin.

A GGUF tensor of a quantized type is `rows` rows of `cols / block` blocks, each block a few
bytes of scales followed by packed small integers. The engine keeps those bytes as they ship
(`uint8 [rows, row_bytes]`, see models/convert.py) instead of dequantizing them to float and
quantizing the floats again, which would lose what the file's quantizer kept.

Every type here is a sequence of units of 32 (Q6_K: 16) small integers `q` with one float scale
and, for the asymmetric types, one float offset: `w = scale * q + offset`, computed in float32 in
the order `gguf.quants.dequantize` computes it, so the twin is equal to it to the bit:

    type   block bytes  unit  q                        scale          offset
    Q8_0   32    34     32    int8                     d              -
    Q5_0   32    22     32    5 bits - 16              d              -
    Q4_1   32    20     32    4 bits                   d              m
    Q4_K   256   144    32    4 bits                   d * sc (6 bit) -dmin * m (6 bit)
    Q6_K   256   210    16    6 bits - 32              d * sc (int8)  -

Four more layouts are repacked at load for the CPU kernel, not a file's, each holding the same
values (so they dequantize to the same bits) in an order that unpacks and sums in fewer
instructions: Q5_0x4 and Q8_0x4 (`group_q5_0`, `group_q8_0`), four
consecutive blocks of a row in their 88 and 136 bytes, interleaved so that each 4-byte lane of a
32-byte vector holds one block's weights; Q4_Kx (`repack_q4_k`), Q4_K with its 6-bit scales
and mins a byte each (148 bytes a block: no unpacking) and its weights in pairs of units; and
Q6_Kx (`repack_q6_k`), Q6_K's values in its 210 bytes with its units of 16 in quads and each
weight's six bits in one byte but for every fourth vector's.

On a GPU, the types whose blocks are not a multiple of 16 bytes (Q8_0's 34, Q5_0's 22, Q6_K's
210) keep their blocks' bytes in planes (`to_planes`, layouts Q8_0g, Q5_0g, Q6_Kg): a row holds
every block's integers, then every block's scales, then zeros up to a multiple of 16 bytes, so
that the integers of a block start 16-byte aligned (4 for Q5_0g) and the GPU reads them in wide
copies it can issue ahead of their use, where the file's layout leaves them 2-byte aligned;
Q5_0g's fifth bits in the order the kernel takes them (`_FIFTH`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant_matmul import _block_sums, _dense, quantize_rows


@dataclass(frozen=True)
class BlockType:
    name: str
    id: int             # the compiled kernel's `type` (csrc/gguf_linear.cpp)
    block: int          # weights per block
    nbytes: int         # bytes per block
    f16: tuple[int, ...]  # where a block keeps its float16 scales
    unit: int           # weights per scale
    act: int            # activations per int8 scale in the matmul: llama.cpp's q8_0 (32) or q8_K (256)


TYPES = {t.name: t for t in (
    BlockType("Q8_0", 0, 32, 34, (0,), 32, 32),
    BlockType("Q5_0", 1, 32, 22, (0,), 32, 32),
    BlockType("Q4_1", 2, 32, 20, (0, 2), 32, 32),
    BlockType("Q4_K", 3, 256, 144, (0, 2), 32, 256),
    BlockType("Q6_K", 4, 256, 210, (208,), 16, 256),
    BlockType("Q5_0x4", 5, 128, 88, (0, 2, 4, 6), 32, 32),
    BlockType("Q4_Kx", 6, 256, 148, (0, 2), 32, 256),
    BlockType("Q8_0x4", 7, 128, 136, (0, 2, 4, 6), 32, 32),
    BlockType("Q6_Kx", 8, 256, 210, (208,), 16, 256),
)}
# A file's type -> the CPU kernel's layout of it.
LAYOUTS = {"Q5_0": "Q5_0x4", "Q8_0": "Q8_0x4", "Q4_K": "Q4_Kx", "Q6_K": "Q6_Kx"}
FILE_TYPES = tuple(t for t in TYPES if t not in LAYOUTS.values())   # the GGUF types read as stored
# Where a file type's block keeps its integers, [lo, hi); the rest (its scales) is one run of
# bytes before or after them. A file's type -> the GPU's planar layout of it.
INTS = {"Q8_0": (2, 34), "Q5_0": (2, 22), "Q4_1": (4, 20), "Q4_K": (16, 144), "Q6_K": (0, 192)}
GPU_LAYOUTS = {"Q8_0": "Q8_0g", "Q5_0": "Q5_0g", "Q6_K": "Q6_Kg"}
PLANAR = {layout: file for file, layout in GPU_LAYOUTS.items()}     # layout -> file type
# Q5_0g's fifth bits in the order the GPU kernel takes its weights, two to a 32-bit word: bit p
# is weight 16 (p % 16 // 8) + 2 (p % 8) + p // 16's, so that one shift brings a word's two to
# bits 0 and 16 (kernels/gguf_quant_triton.py).
_FIFTH = torch.tensor([16 * (p % 16 // 8) + 2 * (p % 8) + p // 16 for p in range(32)])


def _planes(qtype: str, cols: int) -> tuple[int, int, int]:
    """A file type's (blocks a row, integer bytes a block, row bytes in planes with the padding)."""
    t, (lo, hi) = TYPES[qtype], INTS[qtype]
    blocks = cols // t.block
    return blocks, hi - lo, -(-blocks * t.nbytes // 16) * 16


def to_planes(qtype: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Rows of a file type uint8 [rows, row_bytes] -> (the GPU's layout of it, its rows in planes),
    or the type and rows as they are where the type has no planar layout."""
    if qtype not in GPU_LAYOUTS:
        return qtype, w
    (lo, hi), t = INTS[qtype], TYPES[qtype]
    rows, blocks = w.shape[0], w.shape[1] // t.nbytes
    b = w.reshape(rows, blocks, t.nbytes)
    if qtype == "Q5_0":
        b = torch.cat([b[..., :2], _bytes(_bits(b[..., 2:6])[..., _FIFTH.to(w.device)]), b[..., 6:]], -1)
    out = torch.zeros(rows, _planes(qtype, blocks * t.block)[2], dtype=torch.uint8, device=w.device)
    ints, scales = b[..., lo:hi].reshape(rows, -1), torch.cat([b[..., :lo], b[..., hi:]], -1).reshape(rows, -1)
    out[:, :ints.shape[1]] = ints
    out[:, ints.shape[1]:ints.shape[1] + scales.shape[1]] = scales
    return GPU_LAYOUTS[qtype], out


def from_planes(layout: str, w: torch.Tensor, cols: int) -> torch.Tensor:
    """`to_planes`' inverse: a GPU layout's rows -> the file type's rows [rows, row_bytes]."""
    qtype = PLANAR[layout]
    lo, t = INTS[qtype][0], TYPES[qtype]
    blocks, ints, _ = _planes(qtype, cols)
    rows = w.shape[0]
    q = w[:, :blocks * ints].reshape(rows, blocks, ints)
    if qtype == "Q5_0":
        fifth = torch.empty(rows, blocks, 32, dtype=torch.uint8, device=w.device)
        fifth[..., _FIFTH.to(w.device)] = _bits(q[..., :4])
        q = torch.cat([_bytes(fifth), q[..., 4:]], -1)
    rest = w[:, blocks * ints:blocks * t.nbytes].reshape(rows, blocks, t.nbytes - ints)
    return torch.cat([rest[..., :lo], q, rest[..., lo:]], -1).reshape(rows, -1)


# Q5_0x4 and Q8_0x4 interleave four blocks: each of their four vectors of 32 weights holds, in every
# 4-byte lane L, four weights of block L % 4, so the kernel's products sum per lane within one block
# (x takes the same order). Vector k's byte 16 h + 4 b + i is block b's weight 8 k + 4 h + i.
_X4_ORDER = torch.tensor([32 * (p % 16 // 4) + 8 * (p // 32) + 4 * (p % 32 // 16) + p % 4 for p in range(128)])


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes of a little-endian uint32 -> [..., 32] its bits, bit 0 first."""
    at = torch.arange(32, device=b.device)
    return (b[..., at // 8] >> (at % 8).to(torch.uint8)) & 1


def _bytes(bits: torch.Tensor) -> torch.Tensor:
    """`_bits`' inverse: [..., 32] bits (0 or 1, uint8) -> [..., 4] bytes."""
    shift = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.view(*bits.shape[:-1], 4, 8) << shift).sum(-1, dtype=torch.uint8)


def _fifth_bytes(bits: torch.Tensor) -> torch.Tensor:
    """Q5_0x4's fifth bits [n, 4 vectors, 32] (0 or 1) -> their 16 bytes [n, 16]: byte p holds
    weight p's of vector j in bit 4 + j and weight 16 + p's in bit j, so that the kernel brings a
    vector's to bit 4 with one shift (csrc/gguf_linear.cpp's x4_fifth)."""
    shift = torch.tensor([4, 5, 6, 7], dtype=torch.uint8).view(1, 4, 1)
    placed = torch.cat([bits[..., :16] << shift, bits[..., 16:] << (shift - 4)], -1)    # [n, 4, 32]
    both = placed[:, 0] | placed[:, 1] | placed[:, 2] | placed[:, 3]
    return both[:, :16] | both[:, 16:]


def _fifth_bits(f: torch.Tensor) -> torch.Tensor:
    """`_fifth_bytes`' inverse: [n, 16] -> [n, 4, 32]."""
    shift = torch.tensor([4, 5, 6, 7], dtype=torch.uint8, device=f.device).view(1, 4, 1)
    f = f.view(-1, 1, 16)
    return torch.cat([(f >> shift) & 1, (f >> (shift - 4)) & 1], -1)


def group_q5_0(w: torch.Tensor) -> torch.Tensor:
    """Q5_0 rows uint8 [rows, row_bytes] (blocks a multiple of 4 each) -> the same rows as Q5_0x4:
    per four blocks their float16 scales, then their 128 weights as four vectors in _X4_ORDER: the
    vectors' fifth bits (`_fifth_bytes`), then two runs of 32 bytes, each holding two vectors: the
    first's low four bits in the low nibbles, the second's in the high ones."""
    rows = w.shape[0]
    b = w.reshape(-1, 4, 22)
    five = (_nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4)).reshape(-1, 128)[:, _X4_ORDER].view(-1, 4, 32)
    low = five & 0x0F
    return torch.cat([b[..., :2].reshape(-1, 8), _fifth_bytes(five >> 4),
                      (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 64)], -1).reshape(rows, -1)


def group_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Q8_0 rows uint8 [rows, row_bytes] (blocks a multiple of 4 each) -> the same rows as Q8_0x4:
    per four blocks their float16 scales, then their 128 int8 weights in _X4_ORDER."""
    b = w.reshape(-1, 4, 34)
    return torch.cat([b[..., :2].reshape(-1, 8), b[..., 2:].reshape(-1, 128)[:, _X4_ORDER]], -1).reshape(w.shape)


def row_bytes(qtype: str, cols: int) -> int:
    t = TYPES[PLANAR.get(qtype, qtype)]
    if cols % t.block:
        raise ValueError(f"{qtype} rows hold whole blocks of {t.block} weights; got {cols} columns")
    return _planes(PLANAR[qtype], cols)[2] if qtype in PLANAR else cols // t.block * t.nbytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes per value -> float32 (exact)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] packed bytes -> [..., 2n]: the n low nibbles, then the n high ones (GGML's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K blocks [n, 144] -> their 6-bit scales and mins, uint8 [n, 8] each (GGML's packing)."""
    s = blocks[:, 4:16].reshape(-1, 3, 4)
    lo, hi, both = s[:, 0], s[:, 1], s[:, 2]
    return (torch.cat([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], dim=-1),
            torch.cat([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], dim=-1))


def repack_q4_k(w: torch.Tensor) -> torch.Tensor:
    """Q4_K rows uint8 [rows, row_bytes] -> the same values as Q4_Kx rows: per block d and dmin,
    the eight 6-bit scales and eight mins a byte each, then the 128 bytes of weights with each
    run of 32 holding a pair of units, 2 i and 2 i + 1: weight j of the first in the
    low nibble of byte j (j < 16) or the high nibble of byte j - 16, the second's in bytes 16 on.
    A vector's low nibbles are then the first 16 weights of both units, its high ones the last 16,
    and the kernel sums two vectors in int16 before their units' scales multiply."""
    blocks = w.reshape(-1, 144)
    sc, mn = _q4_k_scales(blocks)
    units = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 4, 2, 2, 16)    # [n, pair, unit, half, 16]
    paired = (units[..., 0, :] | (units[..., 1, :] << 4)).reshape(-1, 128)
    return torch.cat([blocks[:, :4], sc, mn, paired], -1).reshape(w.shape[0], -1)


# Q6_Kx's order of a block's weights: per 64 (four units of 16), the first 8 of each unit, then
# the last 8 of each; its vector 2 i + j is then weights 8 j .. 8 j + 7 of each unit of quad i.
_QUADS = torch.tensor([64 * (p // 64) + 8 * (2 * (p % 64 // 8 % 4) + p % 64 // 32) + p % 8 for p in range(256)])


def _q6_k_ints(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, 210] -> their q 0..63 [n, 256]: each half block's four vectors of 32,
    vector j the low nibbles of run j % 2 (j < 2) or its high ones, and bits 2 j, 2 j + 1 of the
    half's 32 bytes of high bits."""
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    return (low | (high << 4)).reshape(n, 256)


def repack_q6_k(w: torch.Tensor) -> torch.Tensor:
    """Q6_K rows uint8 [rows, row_bytes] -> the same values as Q6_Kx rows: per block, each half's
    four vectors of 32 q in _QUADS' order (so that the kernel sums two vectors in int16 before one
    multiply by four units' scales) in three runs of 32 bytes, vector i's six bits in the low bits
    of run i and vector 3's bits 2 i, 2 i + 1 in its top two; then Q6_K's scales and d."""
    blocks = w.reshape(-1, 210)
    q = _q6_k_ints(blocks)[:, _QUADS].reshape(-1, 2, 4, 32)                 # [n, half, vector, 32]
    top = ((q[:, :, 3:] >> torch.tensor([0, 2, 4], dtype=torch.uint8).view(1, 1, 3, 1)) & 3) << 6
    return torch.cat([(q[:, :, :3] | top).reshape(-1, 192), blocks[:, 192:]], -1).reshape(w.shape[0], -1)


def _q6_kx_ints(blocks: torch.Tensor) -> torch.Tensor:
    """`repack_q6_k`'s inverse to q: Q6_Kx blocks [n, 210] -> their q 0..63 [n, 256] in order."""
    runs = blocks[:, :192].reshape(-1, 2, 3, 32)
    shifts = torch.tensor([0, 2, 4], dtype=torch.uint8, device=blocks.device).view(1, 1, 3, 1)
    last = ((runs >> 6) << shifts).sum(2, keepdim=True, dtype=torch.uint8)
    stored = torch.cat([runs & 0x3F, last], 2).reshape(-1, 256)
    return torch.empty_like(stored).index_copy_(1, _QUADS.to(blocks.device), stored)


def repack(qtype: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A tensor of a file's type in the CPU kernel's layout for it (LAYOUTS), where its rows hold
    whole blocks of that layout; any other as it is."""
    layout = LAYOUTS.get(qtype)
    if layout is None or w.shape[1] // TYPES[qtype].nbytes % (TYPES[layout].block // TYPES[qtype].block):
        return qtype, w
    return layout, {"Q5_0": group_q5_0, "Q8_0": group_q8_0, "Q4_K": repack_q4_k, "Q6_K": repack_q6_k}[qtype](w)


def _in_order(vectors: torch.Tensor) -> torch.Tensor:
    """An x4 layout's weights [n, 128] (or [n, 4, 32]) in _X4_ORDER -> its four blocks [n, 4, 32]."""
    blocks = torch.empty(vectors.shape[0], 128, dtype=vectors.dtype, device=vectors.device)
    blocks[:, _X4_ORDER.to(vectors.device)] = vectors.reshape(-1, 128)
    return blocks.view(-1, 4, 32)


def unpack(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`blocks` uint8 [n, nbytes] -> (q int8 [n, block / unit, unit], scale float32 [n, block / unit],
    offset float32 [n, block / unit] or None): the integers and the unit scales the kernels read."""
    n = blocks.shape[0]
    if qtype == "Q8_0":
        d, qs = blocks[:, :2], blocks[:, 2:]
        return qs.contiguous().view(torch.int8).view(n, 1, 32), _f16(d), None
    if qtype == "Q5_0":
        d, qh, qs = blocks[:, :2], blocks[:, 2:6], blocks[:, 6:]
        q = (_nibbles(qs) | (_bits(qh) << 4)).to(torch.int8) - 16
        return q.view(n, 1, 32), _f16(d), None
    if qtype == "Q5_0x4":
        d, qh, qs = blocks[:, :8], blocks[:, 8:24], blocks[:, 24:].reshape(n, 2, 32)
        low = torch.stack([qs & 0x0F, qs >> 4], 2).reshape(n, 4, 32)
        return _in_order((low | (_fifth_bits(qh) << 4)).to(torch.int8) - 16), _f16(d), None
    if qtype == "Q8_0x4":
        return _in_order(blocks[:, 8:].contiguous().view(torch.int8)), _f16(blocks[:, :8]), None
    if qtype == "Q4_1":
        d, m, qs = blocks[:, :2], blocks[:, 2:4], blocks[:, 4:]
        return _nibbles(qs).to(torch.int8).view(n, 1, 32), _f16(d), _f16(m)
    if qtype in ("Q4_K", "Q4_Kx"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        if qtype == "Q4_K":
            sc, mn = _q4_k_scales(blocks)
            # Four runs of 32 bytes: each gives a unit in its low nibbles, the next unit in its high ones.
            q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).to(torch.int8)
        else:
            sc, mn, paired = blocks[:, 4:12], blocks[:, 12:20], blocks[:, 20:].reshape(n, 4, 2, 16)
            q = torch.stack([paired & 0x0F, paired >> 4], 3).reshape(n, 8, 32).to(torch.int8)
        return q, d * sc.to(torch.float32), -(dmin * mn.to(torch.float32))
    if qtype in ("Q6_K", "Q6_Kx"):
        sc, d = blocks[:, 192:208], _f16(blocks[:, 208:210])
        q = _q6_k_ints(blocks) if qtype == "Q6_K" else _q6_kx_ints(blocks)
        return (q.to(torch.int8) - 32).view(n, 16, 16), d * sc.contiguous().view(torch.int8).to(torch.float32), None
    raise ValueError(f"no kernel reads GGUF type {qtype!r}; known: {', '.join(TYPES)}")


def dequantize(w: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] as stored -> float32 [rows, cols], equal to gguf.quants.dequantize."""
    rows = w.shape[0]
    if w.shape[1] != row_bytes(qtype, cols):
        raise ValueError(f"{qtype} rows of {cols} weights take {row_bytes(qtype, cols)} bytes; got {w.shape[1]}")
    if qtype in PLANAR:
        w, qtype = from_planes(qtype, w, cols), PLANAR[qtype]
    t = TYPES[qtype]
    q, scale, offset = unpack(w.reshape(-1, t.nbytes), qtype)
    out = scale[..., None] * q.to(torch.float32)
    if offset is not None:
        out = out + offset[..., None]
    return out.reshape(rows, cols)


# A K-quant's activation block is 256 values, so that the weights' integer sub-block scales multiply
# the integer sums; but one int8 scale over 256 lets an outlier round its block's other values
# away (the 1.5B's perplexity +0.38% on float32's: Qwen's normed hidden states carry outlier
# channels). With steps, each 32 values of the block take a step of their own, a small integer
# multiple (1..steps) of the block's: the integer scale folds into the weights' in int16 and the
# sums stay in int32, while a run of 32 without the outlier keeps up to `steps` times finer steps
# (+0.05% with 8), at a multiply and the sub-block scales' shuffles per row and block, which
# prompts and batches pay (ModelEntry.gguf_steps; docs/engine.md). 8 keeps every int16 product
# below 2**15 (x's unit sums: 8 * 32 * 127; Q6_K's scales: 128 * 8).
MAX_STEPS = 8


def quantize_steps(x: torch.Tensor, block: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float [M, K] as int8 per run of 32 values, each run's step an integer multiple m (1..steps)
    of its block's scale d = max|x| / (127 steps): m = min(steps, floor(steps max|run| / max|x|) + 1),
    the least whose step holds the run's largest value at 127 or below. Returns q int8 [M, K],
    d [M, K // block] and m int16 [M, K // 32]; x ~= q * d * m. steps 1: `quantize_rows`."""
    if steps == 1:
        q, scale = quantize_rows(x, block)
        return q, scale, torch.ones(x.shape[0], x.shape[1] // 32, dtype=torch.int16)
    m, k = x.shape
    runs = x.view(m, k // block, block // 32, 32)
    run_max = runs.abs().amax(-1)
    top = run_max.amax(-1, keepdim=True).clamp(min=1e-8)
    d = top / (127 * steps)
    mult = ((run_max * steps) / top).floor_().add_(1).clamp_(max=steps)
    q = (runs / (d * mult)[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.view(m, k), d.view(m, -1), mult.to(torch.int16).view(m, -1)


def gguf_int8_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, steps: int = 1) -> torch.Tensor:
    """x float32 [M, K] @ the stored tensor w [N, row_bytes].T -> [M, N] by integer dot
    products, as llama.cpp computes on its blocks: x quantized to int8 per block of the type's
    `act` values with a step per 32 of them (`quantize_steps`), per unit the integer sum of its
    products with the weights' integers, times the unit's scale and x's step, plus the unit's
    offset times x's sum over the unit. The twin of kernels/csrc/gguf_linear.cpp (which sums the
    units in float32, in another order). `steps`: the K-quants' (the types of 32 take one)."""
    t = TYPES[qtype]
    (m, k), n = x.shape, w.shape[0]
    q, scale, offset = unpack(w.reshape(-1, t.nbytes), qtype)
    xq, x_scale, mult = quantize_steps(x, t.act, steps if t.act > 32 else 1)
    step = x_scale.double().repeat_interleave(t.act // 32, dim=-1) * mult.double()     # per 32 values
    per_unit = lambda v: v.repeat_interleave(32 // t.unit, dim=-1)       # x's step for each unit
    sums = _block_sums(xq, q.view(n, k), t.unit)                             # [M, N, K / unit]
    y = sums * scale.view(n, -1).double()
    if offset is not None:
        x_sums = xq.view(m, k // t.unit, t.unit).double().sum(-1)
        y = y + offset.view(n, -1).double() * x_sums[:, None]
    return (y * per_unit(step)[:, None]).sum(-1).to(x.dtype)


def gguf_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [M, K] @ the stored tensor w [N, row_bytes].T over its weights dequantized a slice at a
    time, in x's dtype: where no compiled kernel reads the blocks (CUDA, or a CPU without a
    compiler), and the float reference the quantized kernels are measured against."""
    k = x.shape[1]
    return _dense(x, w.shape[0], k, lambda r0, r1: dequantize(w[r0:r1], qtype, k).to(x.dtype))


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Valid blocks of `qtype` with every integer field random and small finite float16 scales
    (random bytes there could be NaN): uint8 [rows, row_bytes], for tests and for benchmarks at
    a model's shapes."""
    if qtype in LAYOUTS.values():             # a layout's valid blocks are a file type's, repacked
        file_type = next(f for f, layout in LAYOUTS.items() if layout == qtype)
        return repack(file_type, random_blocks(file_type, rows, cols, seed))[1]
    if qtype in PLANAR:
        return to_planes(PLANAR[qtype], random_blocks(PLANAR[qtype], rows, cols, seed))[1]
    t = TYPES[qtype]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows * cols // t.block, t.nbytes), dtype=torch.uint8, generator=g)
    for at in t.f16:
        scales = ((torch.rand(len(raw), 1, generator=g) - 0.5) * 0.04).to(torch.float16)
        raw[:, at:at + 2] = scales.view(torch.uint8)
    return raw.view(rows, -1)
