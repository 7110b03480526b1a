"""Paged attention, plain PyTorch: the reference twins of the Triton kernels in attention_triton.py.

KV lives in fixed-size blocks: ``k_cache[num_blocks, block_size, kv_heads, head_dim]``.
A sequence's block table lists its blocks in order (padded with 0), so token ``p`` of the
sequence sits at slot ``block_table[p // block_size] * block_size + p % block_size``.
Query heads ``g*i .. g*i+g-1`` share KV head ``i`` (GQA, g = heads // kv_heads).

int8 KV: the caches are int8 and ``k_scale, v_scale [num_blocks, block_size, kv_heads]`` float32
hold one symmetric scale per token and head (absmax / 127); value = int8 * scale. Every function
takes ``k_scale=None, v_scale=None`` for a float cache.
"""
import torch
import torch.nn.functional as F


def _slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_tables[..., positions // block_size] * block_size + positions % block_size


def _gather(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The cache rows at `slots` [n, kv_heads, head_dim], dequantized to `dtype`."""
    # index_select, not cache[slots]: advanced indexing is ~1000x slower here on CPU.
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    if scale is None:
        return rows
    s = scale.view(-1, scale.shape[-1]).index_select(0, slots)
    return (rows.float() * s[..., None]).to(dtype)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, kv_heads, head_dim] -> int8 values and float32 scales [T, kv_heads] (absmax / 127)."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    q = x / torch.where(scale > 0, scale, 1.0)[..., None]   # an all-zero row stays zero
    # Round half away from zero: the Triton kernel can do exactly this (no rint in its interpreter).
    q = torch.trunc(q + 0.5 * torch.sign(q)).clamp(-127, 127)
    return q.to(torch.int8), scale


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write the step's new keys and values [T, kv_heads, head_dim] into their slots
    (quantizing them when the cache is int8)."""
    kvh, dh = k.shape[1:]
    if k_scale is not None:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        k_scale.view(-1, kvh).index_copy_(0, slot_mapping, ks)
        v_scale.view(-1, kvh).index_copy_(0, slot_mapping, vs)
    k_cache.view(-1, kvh, dh).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, dh).index_copy_(0, slot_mapping, v)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence. q [S, heads, head_dim] -> [S, heads, head_dim].

    Every sequence of the step is gathered into one padded batch so the whole decode is a
    single SDPA call, whatever the number of sequences.
    """
    block_size, kvh, dh = k_cache.shape[1:]
    max_len = int(context_lens.max())
    pos = torch.arange(max_len, device=q.device)
    S, heads = q.shape[:2]
    slots = _slots(block_tables, pos, block_size).view(-1)            # [S * L]
    k = _gather(k_cache, slots, k_scale, q.dtype).view(S, max_len, kvh, dh).transpose(1, 2)  # [S, kvh, L, dh]
    v = _gather(v_cache, slots, v_scale, q.dtype).view(S, max_len, kvh, dh).transpose(1, 2)
    mask = (pos[None, :] < context_lens[:, None])[:, None, None, :]   # [S, 1, 1, L]
    # The query heads that share a KV head become that head's rows: GQA without copying KV
    # (SDPA's own enable_gqa with a mask takes a path ~100x slower on CPU).
    out = F.scaled_dot_product_attention(q.view(S, kvh, heads // kvh, dh), k, v, attn_mask=mask, scale=scale)
    return out.reshape(S, heads, dh)


# From this many query rows after a cached prefix, attention runs as two fused passes (below):
# 2.3-2.9x the masked pass at 256-512 rows over 1,000-8,000 keys on a 2-core AVX2 EPYC, and
# even at 64 rows (0.97-1.4x), slower for a few verified tokens (0.45x at 8).
SPLIT_PREFIX_ROWS = 128


def _prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, scale: float) -> torch.Tensor:
    """q [n, heads, dh] at the last n of k's positions, k/v [kv_heads, ctx, dh]: every query sees
    the whole prefix, and the chunk causally. SDPA's fused CPU kernel takes no offset causal mask
    (a boolean mask sends it down the unfused path), so it runs twice, over the prefix unmasked
    and over the chunk causal, and the two softmaxes are merged by their log-sum-exps."""
    n, prefix = q.shape[0], k.shape[1] - q.shape[0]
    k, v = k.repeat_interleave(groups, 0)[None], v.repeat_interleave(groups, 0)[None]
    qh = q.transpose(0, 1)[None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, lse1 = flash(qh, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)[:2]
    o2, lse2 = flash(qh, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)[:2]
    w = torch.softmax(torch.stack([lse1, lse2]).float(), dim=0)[..., None]
    return (o1 * w[0] + o2 * w[1]).to(q.dtype)[0].transpose(0, 1).reshape(n, q.shape[1], -1)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Ragged query chunks whose keys may include an already-cached prefix.

    q [T, heads, head_dim] holds the sequences' chunks back to back (``query_start_loc``,
    length S+1); sequence ``s`` has ``context_lens[s]`` tokens in cache including its chunk,
    so its query ``i`` sits at position ``context_lens[s] - q_len + i`` and sees keys up to it.
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        q_len = hi - lo
        pos = torch.arange(ctx, device=q.device)
        slots = _slots(block_tables[s], pos, block_size)
        k = _gather(k_cache, slots, k_scale, q.dtype).transpose(0, 1)   # [kvh, ctx, dh]
        v = _gather(v_cache, slots, v_scale, q.dtype).transpose(0, 1)
        kvh, groups = k.shape[0], q.shape[1] // k.shape[0]
        if q_len == ctx:        # nothing cached before the chunk: plain causal, fused kernel
            # Repeat KV per query head rather than enable_gqa: SDPA's GQA takes the unfused
            # math path on CPU (~1.4x slower here); the copy is small next to the matmuls. The
            # fused kernel also wants a batch dimension: 3-D inputs take the unfused math path.
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], k[None], v[None], is_causal=True,
                                               scale=scale)[0]
            out[lo:hi] = o.transpose(0, 1)
            continue
        if q_len >= SPLIT_PREFIX_ROWS and q.device.type == "cpu":     # the fused op is the CPU's own
            out[lo:hi] = _prefix_then_causal(q[lo:hi], k, v, groups, scale)
            continue
        # A few tokens after a cached prefix (speculative verification, a short chunk): the query
        # heads sharing a KV head become that head's rows, as in decode, so KV is not copied
        # (about 2x faster for a few verified tokens over a passage-sized context).
        qs = q[lo:hi].view(q_len, kvh, groups, -1).permute(1, 2, 0, 3).reshape(kvh, groups * q_len, -1)
        qpos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = (pos[None, :] <= qpos[:, None]).repeat(groups, 1)    # causal, offset by prefix
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[lo:hi] = o.view(kvh, groups, q_len, -1).permute(2, 0, 1, 3).reshape(q_len, q.shape[1], -1)
    return out
