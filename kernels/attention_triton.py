"""Paged attention in Triton; same signatures as the references in attention.py.

Caches must be contiguous ``[num_blocks, block_size, kv_heads, head_dim]`` (norm_rope_triton's
`rotary_store_kv` writes them); q may be a strided view as long as head_dim is contiguous.
Offsets into the caches are int64: a large KV pool passes 2**31 elements.
The softmax runs online (flash-attention style) in fp32, in base 2 with log2(e) folded into
the scale, because exp2 is the hardware instruction.

Launches depend on shapes only, never on values read back from the device, so the engine can
capture decode in CUDA graphs. When few sequences would leave SMs idle, decode splits each
context over several programs and a second kernel merges their partial outputs
(flash-decoding). Tile sizes keep every kernel within the 99 KB of shared memory a block gets
on consumer GPUs at head_dim 128, float32 included (tests/test_kernels.py compiles them for
sm_86 and sm_90 to check).
"""
import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _kv_tile(q, k_cache, v_cache, k_scale, block_tables, s, stride_bt, block_size, kvh, pos, ctx, d, d_mask,
             KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """One tile of keys through the block table: raw scores q.k^T [rows, BLOCK_N], the
    values, and each key's slot and validity (both kernels mask on top of these)."""
    valid = pos < ctx
    block = tl.load(block_tables + s * stride_bt + pos // block_size, mask=valid, other=0)
    slot = block.to(tl.int64) * block_size + pos % block_size
    kv_off = (slot * KV_HEADS + kvh) * HEAD_DIM
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(k))
    if QUANT:  # a per-token scale factors out of the dot product
        scores *= tl.load(k_scale + slot * KV_HEADS + kvh, mask=valid, other=0.0)[None, :]
    return scores, v, slot, valid


@triton.jit
def _online_softmax(scores, v, q, slot, valid, v_scale, kvh, m_i, l_i, acc,
                    KV_HEADS: tl.constexpr, QUANT: tl.constexpr):
    """Fold a tile of masked, scaled scores into the running max, sum and output."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if QUANT:
        p *= tl.load(v_scale + slot * KV_HEADS + kvh, mask=valid, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, out_ptr, lse_ptr,
                   qk_scale, block_size, num_splits, stride_qs, stride_qh, stride_bt, stride_os, stride_oh,
                   stride_osplit,
                   KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   QUANT: tl.constexpr, PARTIAL: tl.constexpr):
    # One program per (sequence, KV head, split of the context): the GROUP query heads sharing
    # that KV head are the rows of one tile, so each key and value is read once for all of them.
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + s * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    ctx = tl.load(context_lens + s)
    # The split count comes from host-known shapes (a CUDA graph replays it for any lengths),
    # so each program sizes its range from the length it reads here: whole tiles, which leaves
    # the last splits of a short context empty.
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        scores, v, slot, valid = _kv_tile(q, k_cache, v_cache, k_scale, block_tables, s, stride_bt, block_size,
                                          kvh, start + n, ctx, d, d_mask, KV_HEADS, HEAD_DIM, QUANT)
        # Every tile holds at least one valid key (start < ctx), so the running max is finite.
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax(scores, v, q, slot, valid, v_scale, kvh, m_i, l_i, acc, KV_HEADS, QUANT)
    # An empty split keeps acc = 0 and m_i = -inf: with its sum taken as 1 its partial is 0 and
    # its log-sum-exp -inf, not NaN.
    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    rows = s * stride_os + heads * stride_oh + split * stride_osplit
    tl.store(out_ptr + rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])
    if PARTIAL:   # the log-sum-exp in base 2, as the scores
        tl.store(lse_ptr + (s * KV_HEADS * GROUP + heads) * num_splits + split, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, num_splits, stride_os, stride_oh,
                    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (sequence, query head): the splits' partial outputs, each weighted by
    # its share of the softmax sum (flash-decoding's recombination).
    s = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    i_mask = i < num_splits
    d_mask = d < HEAD_DIM
    rows = (s * HEADS + h) * num_splits + i
    lse = tl.load(lse_ptr + rows, mask=i_mask, other=float("-inf"))
    # Split 0 starts at key 0, so for any context of a token or more the max is finite and an
    # empty split's weight exactly 0.
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(part_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=i_mask[:, None] & d_mask[None, :],
                   other=0.0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + s * stride_os + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, query_start_loc,
                    out_ptr, qk_scale, block_size, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
                    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    QUANT: tl.constexpr):
    # One program per (sequence, query head, tile of BLOCK_M queries of that sequence's chunk).
    s = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc + s)
    q_len = tl.load(query_start_loc + s + 1) - q_start
    if tile * BLOCK_M >= q_len:   # the grid is sized for the longest chunk of the batch
        return
    ctx = tl.load(context_lens + s)
    kvh = h // GROUP
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q_pos = ctx - q_len + m                                           # causal, offset by the cached prefix
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past the tile's last query are masked for every row: stop there.
    end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        pos = start + n
        scores, v, slot, valid = _kv_tile(q, k_cache, v_cache, k_scale, block_tables, s, stride_bt, block_size,
                                          kvh, pos, ctx, d, d_mask, KV_HEADS, HEAD_DIM, QUANT)
        # Key 0 is in the first tile and every row sees it, so the running max is finite.
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(seen, scores * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax(scores, v, q, slot, valid, v_scale, kvh, m_i, l_i, acc, KV_HEADS, QUANT)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> bool:
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    quant = k_scale is not None
    assert quant == (v_scale is not None) and quant == (k_cache.dtype == torch.int8)
    assert not quant or (k_scale.is_contiguous() and v_scale.is_contiguous())
    return quant


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# The combine kernel holds every split's partial row in one tile (64 x 128 fp32: 32 KB of
# registers); at batch 1 with 2 KV heads 64 splits already make a program per SM of an H100.
MAX_SPLITS = 64


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1   # the interpreter runs one program at a time: splitting gains nothing there


def _num_splits(programs: int, max_context: int, sms: int, block_n: int) -> int:
    """How many parts to split each context into, so that `programs` (sequence, KV head)
    pairs become about one program per SM. From shapes only: a captured CUDA graph replays
    the same split for every context length up to `max_context`."""
    splits = round(sms / programs)   # 1 once the pairs fill two thirds of the chip
    return max(1, min(splits, MAX_SPLITS, triton.cdiv(max_context, block_n)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           num_splits: int | None = None, block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """`num_splits` None chooses from the shapes and the SM count (flash-decoding when few
    sequences leave SMs idle); 1 is one pass per (sequence, KV head) with no combine step."""
    quant = _check_cache(k_cache, v_cache, k_scale, v_scale)
    q = _last_dim_contiguous(q)
    S, heads, dh = q.shape
    block_size, kvh = k_cache.shape[1:3]
    if num_splits is None:
        num_splits = _num_splits(S * kvh, block_tables.shape[1] * block_size, _sm_count(q.device), block_n)
    out = torch.empty(S, heads, dh, dtype=q.dtype, device=q.device)
    # Splits write fp32 partials and their log-sum-exps for the combine kernel to merge.
    partial = num_splits > 1
    dest = torch.empty(S, heads, num_splits, dh, dtype=torch.float32, device=q.device) if partial else out[:, :, None]
    lse = torch.empty(S, heads, num_splits, dtype=torch.float32, device=q.device) if partial else None
    block_d = max(16, triton.next_power_of_2(dh))
    # tl.dot wants every dimension >= 16: a small group is padded with masked rows.
    block_g = max(16, triton.next_power_of_2(heads // kvh))
    _decode_kernel[(S, kvh, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, dest, lse,
        scale * LOG2E, block_size, num_splits, q.stride(0), q.stride(1), block_tables.stride(0),
        dest.stride(0), dest.stride(1), dest.stride(2),
        KV_HEADS=kvh, GROUP=heads // kvh, HEAD_DIM=dh, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        QUANT=quant, PARTIAL=partial, num_warps=num_warps)
    if partial:
        _combine_kernel[(S, heads)](dest, lse, out, num_splits, out.stride(0), out.stride(1),
                                    HEADS=heads, HEAD_DIM=dh, BLOCK_S=triton.next_power_of_2(num_splits),
                                    BLOCK_D=block_d, num_warps=num_warps)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            block_m: int = 64, block_n: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """`block_n` None: 64 keys a tile, 32 in float32, whose 64-key tiles at head_dim 128 want
    113 KB of shared memory, more than the 99 KB a block gets on consumer GPUs."""
    quant = _check_cache(k_cache, v_cache, k_scale, v_scale)
    q = _last_dim_contiguous(q)
    T, heads, dh = q.shape
    block_n = block_n or (64 if q.element_size() <= 2 else 32)
    S = context_lens.shape[0]
    block_size, kvh = k_cache.shape[1:3]
    out = torch.empty(T, heads, dh, dtype=q.dtype, device=q.device)
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (S, heads, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, query_start_loc,
                          out, scale * LOG2E, block_size, q.stride(0), q.stride(1), block_tables.stride(0),
                          out.stride(0), out.stride(1),
                          KV_HEADS=kvh, GROUP=heads // kvh, HEAD_DIM=dh, BLOCK_M=block_m,
                          BLOCK_D=max(16, triton.next_power_of_2(dh)), BLOCK_N=block_n,
                          QUANT=quant, num_warps=num_warps)
    return out
