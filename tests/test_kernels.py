"""Kernels: the plain-PyTorch references against dense math, then every Triton kernel against its
reference on CPU under TRITON_INTERPRET=1 (set in conftest), in float32 because the interpreter
gets bf16 wrong (see docs/kernels.md). Shapes are small but cross page, tile and group boundaries."""
import importlib
import inspect
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import attention, norm_rope, quant_matmul

HEAD_DIM = 64
PAGE = 8                         # KV block size: small, so sequences span several blocks
SCALE = HEAD_DIM ** -0.5


@dataclass
class Paged:
    k: list[torch.Tensor]        # per sequence, dense [len, kv_heads, head_dim] as written
    v: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor

    def caches(self):
        return self.k_cache, self.v_cache

    def scales(self):
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def dense(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence s's K and V as the cache holds them (dequantized when int8)."""
        if self.k_scale is None:
            return self.k[s], self.v[s]
        return tuple(q.float() * sc[..., None] for q, sc in map(attention.quantize_kv, (self.k[s], self.v[s])))


def make_paged(lens: list[int], kv_heads: int, quant: bool, seed: int = 0) -> Paged:
    """Random K/V for sequences of `lens` tokens, written with `store` into shuffled blocks.

    Every block is in use, block 0 included, so the 0 that pads a block table points at
    another sequence's data: reading past a context length would show.
    """
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // PAGE) for n in lens]
    num_blocks = sum(counts)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    slots, used = [], 0
    for s, (n, c) in enumerate(zip(lens, counts)):
        tables[s, :c] = perm[used:used + c]
        used += c
        slots += [int(tables[s, p // PAGE]) * PAGE + p % PAGE for p in range(n)]
    T = sum(lens)
    k = torch.randn(T, kv_heads, HEAD_DIM, generator=g)
    v = torch.randn(T, kv_heads, HEAD_DIM, generator=g)
    k[0, 0, :3] = torch.tensor([127, 2.5, -2.5]) / 64   # scale 1/64: exact rounding ties for int8
    shape = (num_blocks, PAGE, kv_heads, HEAD_DIM)
    dtype = torch.int8 if quant else torch.float32
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_scale = torch.zeros(shape[:3]) if quant else None
    v_scale = torch.zeros(shape[:3]) if quant else None
    slot_mapping = torch.tensor(slots)
    attention.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return Paged(list(k.split(lens)), list(v.split(lens)), k_cache, v_cache, k_scale, v_scale, tables,
                 torch.tensor(lens), slot_mapping)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of q [n, heads, d] over the last n of k, v [L, kv_heads, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))   # [heads, L, d]
    L, n = k.shape[1], q.shape[0]
    mask = torch.ones(L, L, dtype=torch.bool).tril()[L - n:]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=SCALE).transpose(0, 1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K // 2] bytes, low nibble = even k."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


# GQA ratio 1, and 3 (not a power of two, as Qwen2.5-1.5B's 12 heads over 2 KV heads).
HEADS = [(2, 2), (6, 2)]
# GQA groups 1, 2 and 6 (Qwen2.5-1.5B's 12 heads over 2 KV heads) for the decode kernel.
DECODE_HEADS = [(2, 2), (4, 2), (12, 2)]
# One token, under a tile, one tile, and 150 over 19 pages: in 7 splits of whole 16-key tiles
# the 150 leave their last two splits empty, the 1, 5 and 16 all but their first.
SPLIT_LENS = [150, 1, 5, 37, 16]
DECODE_LENS = [37, 5, 16, 20]                    # a sequence of exactly two pages, one of < 1 page
PREFILL = [(37, 13), (9, 9), (20, 1), (16, 16)]  # (context incl. chunk, chunk): cached prefixes 24, 0, 19, 0

triton_only = pytest.mark.usefixtures("needs_triton")


@pytest.fixture
def needs_triton():
    pytest.importorskip("triton")


# ---- the references against dense math ----

def test_quantize_kv_is_symmetric_absmax():
    x = torch.randn(5, 2, HEAD_DIM)
    x[3, 1] = 0
    q, scale = attention.quantize_kv(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 2)
    assert torch.equal(scale, x.abs().amax(-1) / 127)
    assert torch.equal(q[3, 1], torch.zeros(HEAD_DIM, dtype=torch.int8))
    assert torch.equal(q.abs().amax(-1)[scale > 0], torch.full((9,), 127, dtype=torch.int8))
    assert ((q.float() * scale[..., None] - x).abs() <= scale[..., None] / 2 + 1e-7).all()
    q, _ = attention.quantize_kv(torch.tensor([[[127, 2.5, -2.5, 0.5, -0.5]]]) / 64)
    assert q.tolist() == [[[127, 3, -3, 1, -1]]]                # ties round away from zero


@pytest.mark.parametrize("quant", [False, True])
def test_store_kv_reference_writes_each_token_to_its_slot(quant):
    p = make_paged(DECODE_LENS, 2, quant)
    for s, n in enumerate(DECODE_LENS):
        slots = p.block_tables[s, torch.arange(n) // PAGE] * PAGE + torch.arange(n) % PAGE
        k, v = p.dense(s)
        got_k = p.k_cache.view(-1, 2, HEAD_DIM)[slots]
        if quant:
            got_k = got_k.float() * p.k_scale.view(-1, 2)[slots][..., None]
        torch.testing.assert_close(got_k, k, rtol=0, atol=0)


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_decode_reference_matches_dense_attention(heads, kv_heads, quant):
    p = make_paged(DECODE_LENS, kv_heads, quant)
    q = torch.randn(len(DECODE_LENS), heads, HEAD_DIM)
    out = attention.paged_decode_attention(q, *p.caches(), p.block_tables, p.context_lens, SCALE, **p.scales())
    for s in range(len(DECODE_LENS)):
        torch.testing.assert_close(out[s:s + 1], dense_attention(q[s:s + 1], *p.dense(s)))


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_prefill_reference_matches_dense_causal_attention(heads, kv_heads, quant):
    # ... and 40 cached tokens before a chunk long enough for two fused passes (SPLIT_PREFIX_ROWS)
    ctx, chunk = zip(*PREFILL, (40 + attention.SPLIT_PREFIX_ROWS, attention.SPLIT_PREFIX_ROWS))
    p = make_paged(list(ctx), kv_heads, quant)
    q = torch.randn(sum(chunk), heads, HEAD_DIM)
    qsl = torch.tensor([0, *torch.tensor(chunk).cumsum(0).tolist()])
    out = attention.paged_prefill_attention(q, *p.caches(), p.block_tables, p.context_lens, qsl, SCALE,
                                            **p.scales())
    for s in range(len(ctx)):
        lo, hi = qsl[s], qsl[s + 1]
        torch.testing.assert_close(out[lo:hi], dense_attention(q[lo:hi], *p.dense(s)))


def test_a_fresh_prompt_runs_sdpa_fused_kernel():
    """A chunk with nothing cached before it takes SDPA's fused CPU kernel: 3-D inputs sent it down
    the unfused math path (a score matrix per head, bmm and softmax), several times slower."""
    p = make_paged([64], 2, False)
    q = torch.randn(64, 6, HEAD_DIM)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention.paged_prefill_attention(q, *p.caches(), p.block_tables, p.context_lens, torch.tensor([0, 64]), SCALE)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops and "aten::bmm" not in ops, ops


def test_int8_kv_attention_stays_close_to_float():
    pf, pq = make_paged(DECODE_LENS, 2, False), make_paged(DECODE_LENS, 2, True)
    q = torch.randn(len(DECODE_LENS), 6, HEAD_DIM)
    args = (pf.block_tables, pf.context_lens, SCALE)
    exact = attention.paged_decode_attention(q, *pf.caches(), *args)
    approx = attention.paged_decode_attention(q, *pq.caches(), *args, **pq.scales())
    torch.testing.assert_close(approx, exact, rtol=0, atol=0.03)


def test_int8_matmul_reference_matches_dense():
    x, w, scales = torch.randn(3, 40), torch.randint(-127, 128, (24, 40), dtype=torch.int8), torch.rand(24)
    dense = torch.stack([w[n].float() * scales[n] for n in range(24)])
    # The scale applies after the sum, in float32: the same value rounded in another order.
    torch.testing.assert_close(quant_matmul.int8_matmul(x, w, scales), x @ dense.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,K,N", [(1, 896, 1152), (3, 96, 37), (8, 1536, 64), (9, 64, 5), (13, 256, 40),
                                   (70, 2048, 300)])
def test_compiled_cpu_integer_kernels_equal_their_twins(M, K, N):
    """kernels/quant_matmul_cpu.py (AVX2, built here) against its PyTorch twins: the same
    activations rounded per block (blocks of 128, 64 and 32 included, row blocks of 1 to 8, a
    prompt's rows over several cache tiles of outputs), the same integer sums per block, the
    blocks summed in float32 in another order."""
    from kernels import quant_matmul_cpu
    if quant_matmul_cpu.load() is None:
        pytest.skip("the CPU integer kernels cannot be built here (no AVX2, C++ compiler or ninja)")
    g = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 2, M)[:, None]

    def close(got, want):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().amax(1, keepdim=True).max().item())
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scales = torch.rand(N, generator=g)
    block = quant_matmul.act_block(K)
    close(quant_matmul_cpu.load().int8_linear(x, w, scales, block), quant_matmul.int8_int8_matmul(x, w, scales, block))
    for group in (32, 64, 128):
        if K % group:
            continue
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
        s, z = torch.rand(N, K // group, generator=g), torch.rand(N, K // group, generator=g) * 15
        close(quant_matmul_cpu.load().int4_linear(x, q, s, (z * s).contiguous(), group),
              quant_matmul.int4_int8_matmul(x, q, s, z, group))


VNNI_CHILD = """
import sys, torch
from kernels import quant_matmul, quant_matmul_cpu
ops, g, out = quant_matmul_cpu.load(), torch.Generator().manual_seed(3), []
for M, K, N in ((1, 1536, 40), (5, 896, 24), (8, 96, 16), (300, 4864, 8)):
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 2, M)[:, None]
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    out.append(ops.int8_linear(x, w, torch.rand(N, generator=g), quant_matmul.act_block(K)))
    for group in (32, 128)[:1 + (K % 128 == 0)]:
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
        s = torch.rand(N, K // group, generator=g)
        out.append(ops.int4_linear(x, q, s, (torch.rand(N, K // group, generator=g) * 15 * s).contiguous(), group))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not torch.cpu._is_vnni_supported(), reason="no AVX-512 VNNI on this CPU")
def test_the_vnni_build_equals_the_avx2_build_to_the_bit(tmp_path):
    """Built with VNNI's byte dot products (two chains of them per row where a block allows) or
    with AVX2's maddubs, the kernels sum the same integers, so every output is the same float:
    int8 at one and two chains, int4 at groups of 32 and 128, 1 to 300 rows. Each build in its
    own process (both register the same operators)."""
    got = {}
    for flag in ("0", "1"):
        path = tmp_path / f"vnni-{flag}.pt"
        subprocess.run([sys.executable, "-c", VNNI_CHILD, str(path)], check=True, cwd=Path(__file__).parents[1],
                       env=os.environ | {"SLUICE_CPU_VNNI": flag, "PYTHONPATH": str(Path(__file__).parents[1])})
        got[flag] = torch.load(path)
    assert len(got["0"]) == 11
    for avx2, vnni in zip(got["0"], got["1"]):
        assert torch.equal(avx2, vnni)


def test_int8_register_tiles_equal_the_row_kernel_to_the_bit():
    """VNNI builds take int8 prompts (16 rows or more) through register tiles of 4 rows by 3
    outputs on x + 128, the offset's products taken off by the weights' sums: the same integers
    and float arithmetic as the row kernel (set_tile_rows: from how many rows), so the same
    outputs, at row and output counts that leave partial tiles and inputs long enough to be read
    in several spans."""
    from kernels import cpu_build, quant_matmul_cpu
    ops = quant_matmul_cpu.load()
    if ops is None or not cpu_build.vnni():
        pytest.skip("int8's register tiles are built only with AVX-512 VNNI")
    g = torch.Generator().manual_seed(5)
    was = ops.set_tile_rows(1)
    try:
        for M, K, N in ((16, 8960, 40), (23, 1536, 17), (70, 896, 64), (3, 4864, 5)):
            x = torch.randn(M, K, generator=g) * torch.logspace(-3, 2, M)[:, None]
            w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
            s = torch.rand(N, generator=g)
            ops.set_tile_rows(1)
            tiled = ops.int8_linear(x, w, s, 128)
            ops.set_tile_rows(M + 1)
            assert torch.equal(tiled, ops.int8_linear(x, w, s, 128)), (M, K, N)
        with pytest.raises(RuntimeError, match="rows must be >= 1"):
            ops.set_tile_rows(0)
    finally:
        ops.set_tile_rows(was)


def test_prefetching_weights_changes_no_result():
    """The compiled kernels' software prefetch (set_prefetch, 0: none) is a hint to the cache:
    the same outputs to the bit at every distance, a 1-row decode and an 8-row block alike."""
    from kernels import quant_matmul_cpu
    ops = quant_matmul_cpu.load()
    if ops is None:
        pytest.skip("the CPU integer kernels cannot be built here (no AVX2, C++ compiler or ninja)")
    g = torch.Generator().manual_seed(1)
    w8 = torch.randint(-127, 128, (300, 1536), dtype=torch.int8, generator=g)
    w4 = torch.randint(0, 256, (300, 768), dtype=torch.uint8, generator=g)
    s8, s4, zs = torch.rand(300, generator=g), torch.rand(300, 12, generator=g), torch.rand(300, 12, generator=g)
    was = ops.set_prefetch(0)
    try:
        for rows in (1, 8):
            x = torch.randn(rows, 1536, generator=g)
            outs = []
            for ahead in (0, 64, 2048, 1 << 20):       # the last far past every buffer's end
                ops.set_prefetch(ahead)
                outs.append((ops.int8_linear(x, w8, s8, 128), ops.int4_linear(x, w4, s4, zs, 128)))
            for got in outs[1:]:
                assert torch.equal(got[0], outs[0][0]) and torch.equal(got[1], outs[0][1])
        with pytest.raises(RuntimeError, match="bytes must be >= 0"):
            ops.set_prefetch(-1)
    finally:
        ops.set_prefetch(was)


def test_compiled_cpu_activation_rounding_equals_its_twin():
    """The compiled kernel rounds the activations as quantize_rows does, to the bit: a weight of
    one 1 in each block reads back each block's first value, rounded."""
    from kernels import quant_matmul_cpu
    if quant_matmul_cpu.load() is None:
        pytest.skip("the CPU integer kernels cannot be built here (no AVX2, C++ compiler or ninja)")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)) * 10
    xq, xs = quant_matmul.quantize_rows(x, 128)
    w = torch.zeros(4, 512, dtype=torch.int8)
    w[torch.arange(4), torch.arange(4) * 128] = 1
    got = quant_matmul_cpu.load().int8_linear(x, w, torch.ones(4), 128)
    assert torch.equal(got, xq[:, ::128].float() * xs)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_matmul_reference_matches_dense(group):
    N, K = 24, 256
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    scales, zeros = torch.rand(N, K // group), torch.rand(N, K // group) * 15   # fractional zeros
    dense = torch.empty(N, K)
    for k in range(K):
        dense[:, k] = (q[:, k].float() - zeros[:, k // group]) * scales[:, k // group]
    x = torch.randn(3, K)
    torch.testing.assert_close(quant_matmul.int4_matmul(x, pack_int4(q), scales, zeros, group), x @ dense.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_reference_matches_hugging_face(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    hf = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.2)
    x, res = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    normed, new_res = norm_rope.add_rms_norm(x, res, hf.weight.detach(), 1e-6)
    assert torch.equal(new_res, x + res)
    assert torch.equal(normed, hf(x + res).detach())
    normed, new_res = norm_rope.add_rms_norm(x, None, hf.weight.detach(), 1e-6)
    assert new_res is x and torch.equal(normed, hf(x).detach())


def test_apply_rotary_reference_takes_both_cos_layouts():
    """[T, head_dim / 2], and the engine's [T, 1, head_dim / 2] (Rotary.forward): one rotation."""
    x, cos, sin = torch.randn(5, 3, HEAD_DIM), torch.randn(5, HEAD_DIM // 2), torch.randn(5, HEAD_DIM // 2)
    assert torch.equal(norm_rope.apply_rotary(x, cos, sin), norm_rope.apply_rotary(x, cos[:, None], sin[:, None]))


# ---- the Triton kernels against their references (interpreted) ----

def decode_case(lens: list[int], heads: int, kv_heads: int, quant: bool, table_width: int = 0):
    """Decode arguments over paged caches for `lens`, q a strided view out of a fused qkv
    projection as the engine makes it, block tables padded to `table_width` columns as a
    captured graph's are; and the int8 scales."""
    p = make_paged(lens, kv_heads, quant)
    tables = F.pad(p.block_tables, (0, max(0, table_width - p.block_tables.shape[1])))
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * HEAD_DIM)
    q = qkv[:, :heads * HEAD_DIM].view(-1, heads, HEAD_DIM)
    return (q, *p.caches(), tables, p.context_lens, SCALE), p.scales()


def fill_empty_with_nan(monkeypatch):
    """torch.empty's float tensors hold NaN: an output row, partial or log-sum-exp that a
    kernel leaves unwritten shows in its result."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)


@triton_only
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("heads,kv_heads", DECODE_HEADS)
def test_triton_paged_decode_attention(heads, kv_heads, quant, num_splits, monkeypatch):
    from kernels import attention_triton
    args, scales = decode_case(SPLIT_LENS, heads, kv_heads, quant)
    want = attention.paged_decode_attention(*args, **scales)
    fill_empty_with_nan(monkeypatch)
    # Tiles of 16 keys over pages of 8: a tile spans two blocks, and a context several tiles.
    got = attention_triton.paged_decode_attention(*args, **scales, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@triton_only
@pytest.mark.parametrize("sms,splits", [(132, 13), (8, 1)])
def test_triton_decode_splits_when_sequences_leave_sms_idle(sms, splits, monkeypatch):
    from kernels import attention_triton
    # Tables 64 pages wide, as a graph captured for 512 tokens: the split count is sized for
    # that, whatever the lengths, and most splits of these short contexts are empty.
    args, scales = decode_case(SPLIT_LENS, 12, 2, True, table_width=64)
    want = attention.paged_decode_attention(*args, **scales)
    launches = {name: [] for name in ("_decode_kernel", "_combine_kernel")}
    for name, grids in launches.items():
        monkeypatch.setattr(attention_triton, name, _Spy(getattr(attention_triton, name), grids))
    monkeypatch.setattr(attention_triton, "_sm_count", lambda device: sms)
    fill_empty_with_nan(monkeypatch)
    got = attention_triton.paged_decode_attention(*args, **scales, block_n=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # 5 sequences x 2 KV heads: 13 splits make 130 programs for 132 SMs; 10 pairs already
    # fill 8 SMs, so one pass and no combine step.
    assert launches == {"_decode_kernel": [(5, 2, splits)], "_combine_kernel": [(5, 12)] if splits > 1 else []}


@triton_only
def test_decode_split_count_fills_the_chip_from_shapes_alone():
    from kernels.attention_triton import MAX_SPLITS, _num_splits
    # Qwen2.5-1.5B (2 KV heads) on an H100's 132 SMs, graphs captured for 32k tokens.
    assert _num_splits(1 * 2, 32768, 132, 64) == MAX_SPLITS
    assert _num_splits(8 * 2, 32768, 132, 64) == 8
    assert _num_splits(32 * 2, 32768, 132, 64) == 2
    assert _num_splits(48 * 2, 32768, 132, 64) == 1     # 96 of 132 SMs: splitting would not pay
    assert _num_splits(1 * 2, 100, 132, 64) == 2        # never more splits than tiles of keys


@triton_only
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_triton_paged_prefill_attention(heads, kv_heads, quant):
    from kernels import attention_triton
    ctx, chunk = zip(*PREFILL)
    p = make_paged(list(ctx), kv_heads, quant)
    q = torch.randn(sum(chunk), heads, HEAD_DIM)
    qsl = torch.tensor([0, *torch.tensor(chunk).cumsum(0).tolist()])
    args = (q, *p.caches(), p.block_tables, p.context_lens, qsl, SCALE)
    # Query tiles of 8: the 13- and 16-token chunks take two, the others leave grid cells empty.
    got = attention_triton.paged_prefill_attention(*args, **p.scales(), block_m=8, block_n=16)
    torch.testing.assert_close(got, attention.paged_prefill_attention(*args, **p.scales()))


@triton_only
@pytest.mark.parametrize("M", [1, 3, 17, 70])
@pytest.mark.parametrize("splits", [None, 2, 3])      # K in slices summed by a second launch
def test_triton_int8_matmul(M, splits):
    from kernels import quant_matmul_triton
    N, K = 80, 600                     # neither a multiple of the blocks
    x, w, scales = torch.randn(M, K), torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N) / 100
    got = quant_matmul_triton.int8_matmul(x, w, scales, splits=splits)
    # Outputs of about 10: float32 sums in another order differ in the sixth digit.
    torch.testing.assert_close(got, quant_matmul.int8_matmul(x, w, scales), rtol=1e-5, atol=1e-4)


# The served models' small projections at 1/16 of their sizes (Qwen2.5-1.5B: hidden 1536, q|k|v
# 2048, o 1536 -> 1536; 0.5B: hidden 896, q|k|v 1152), and sizes that divide no block.
GEMV_SHAPES = [(96, 128), (96, 96), (56, 72), (100, 130)]


@triton_only
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("K,N", GEMV_SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("splits", [None, 1, 3])      # K in slices summed in order by a second launch
def test_triton_gemv_linear(M, K, N, bias, splits, monkeypatch):
    from kernels import gemv, gemv_triton
    torch.manual_seed(M * K + N)
    x, w = torch.randn(M, K), torch.randn(K, N) / K ** 0.5
    b = torch.randn(N) if bias else None
    want = gemv.gemv_linear(x, w, b)
    fill_empty_with_nan(monkeypatch)        # a partial sum or output left unwritten shows
    # Columns of 32: the odd sizes leave a part-filled column; slices of 32 of K, a part-filled one.
    got = gemv_triton.gemv_linear(x, w, b, splits=splits, block_n=32, block_k=32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    again = gemv_triton.gemv_linear(x, w, b, splits=splits, block_n=32, block_k=32)
    assert torch.equal(got, again)          # no atomics: the same bits at every run


@triton_only
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("K,N", GEMV_SHAPES)
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_triton_gemv_linear_reads_int8_and_fp8_weights_with_a_scale_per_output(M, K, N, splits, dtype, monkeypatch):
    from kernels import gemv, gemv_triton
    torch.manual_seed(M * K + N)
    x, b, scales = torch.randn(M, K), torch.randn(N), torch.rand(N) / K
    w = (torch.randint(-127, 128, (K, N)) if dtype == torch.int8 else torch.randn(K, N) * 30).to(dtype)
    want = gemv.gemv_linear(x, w, b, scales)
    torch.testing.assert_close(want, (x @ (w.float() * scales) + b), rtol=1e-5, atol=1e-5)
    fill_empty_with_nan(monkeypatch)
    got = gemv_triton.gemv_linear(x, w, b, scales, splits=splits, block_n=32, block_k=32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@triton_only
def test_triton_fp8_row_quantization_equals_its_twin_to_the_bit():
    """One launch for fp8's activations against quant_matmul.quantize_fp8: the same scales and
    the same e4m3 bits, over rows of every magnitude (subnormals among them), signed zeros,
    every e4m3 value, the midpoints between neighbours (ties to even) and a float32 step either
    side of each; a NaN stays NaN."""
    from kernels import quant_matmul, quant_matmul_triton
    torch.manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite()].unique()
    mid = (values[1:] + values[:-1]) / 2
    grid = torch.cat([values, mid, mid.nextafter(torch.tensor(-1e9)), mid.nextafter(torch.tensor(1e9))])
    rows = [grid, torch.randn(1536) * 1e-4, torch.randn(2500) * 30, torch.tensor([0.0, -0.0, 1e-30, 3.0]),
            torch.zeros(7)]
    for row in rows:
        x = row[None, :]
        q, scale = quant_matmul_triton.quantize_fp8(x)
        want_q, want_scale = quant_matmul.quantize_fp8(x)
        assert torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    assert torch.isnan(quant_matmul_triton.quantize_fp8(x)[0][1, 5].float())


@triton_only
def test_triton_gemv_takes_strided_and_empty_rows_and_its_own_plan():
    from kernels import gemv, gemv_triton
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 2 * 96)[:, ::2], torch.randn(96, 128), torch.randn(128)
    torch.testing.assert_close(gemv_triton.gemv_linear(x, w, b), gemv.gemv_linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert gemv_triton.gemv_linear(x[:0], w, b).shape == (0, 128)


def test_gemv_plan_fills_the_chip_with_columns_then_slices_of_k():
    from kernels.gemv_triton import plan
    fill = 2 * 132          # an H100's or H200's SMs, two programs each
    # 1.5B q|k|v at one row: 64 columns of 32 outputs, K in 4 slices of 384 (5 asked, whole 128s).
    assert plan(1, 2048, 1536, fill) == (16, 32, 4)
    assert plan(1, 1536, 1536, fill) == (16, 32, 6)         # o: 48 columns, 6 slices
    assert plan(1, 1152, 896, fill) == (16, 32, 7)          # 0.5B q|k|v: a slice per 128 of K
    assert plan(1, 17920, 1536, fill) == (16, 64, 1)        # gate|up fills the chip with columns alone
    assert plan(64, 2048, 1536, fill) == (64, 32, 4)
    assert plan(24, 2048, 1536, fill)[0] == 32


@triton_only
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_triton_int4_matmul(group, M):
    from kernels import quant_matmul_triton
    N, K = 40, 256
    w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    scales, zeros = torch.rand(N, K // group) / 10, torch.rand(N, K // group) * 15
    x = torch.randn(M, K)
    # K tiles of 64: two groups per tile at group 32, two tiles per group at 128.
    got = quant_matmul_triton.int4_matmul(x, w, scales, zeros, group, block_n=32, block_k=64)
    torch.testing.assert_close(got, quant_matmul.int4_matmul(x, w, scales, zeros, group))


@triton_only
@pytest.mark.parametrize("with_residual", [True, False])
def test_triton_add_rms_norm(with_residual):
    from kernels import norm_rope_triton
    x, res, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)   # 96: a masked tail in the block
    res = res if with_residual else None
    got, want = norm_rope_triton.add_rms_norm(x, res, w, 1e-6), norm_rope.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---- the compiled CPU kernels (kernels/layer_cpu.py) against their twins ----

def cpu_ops():
    from kernels import layer_cpu
    if layer_cpu.load() is None:
        pytest.skip("the compiled CPU kernels cannot be built here (no AVX2, C++ compiler or ninja)")
    return layer_cpu.load()


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("heads,kv_heads", DECODE_HEADS)
def test_compiled_cpu_paged_decode_attention(heads, kv_heads, quant, monkeypatch):
    # Tables padded past the longest sequence, as a captured graph's are: padding is never read.
    args, scales = decode_case(SPLIT_LENS, heads, kv_heads, quant, table_width=32)
    want = attention.paged_decode_attention(*args, **scales)
    fill_empty_with_nan(monkeypatch)
    torch.testing.assert_close(cpu_ops().paged_decode_attention(*args, **scales), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_compiled_cpu_rotary_and_cache_write_equal_their_twin(heads, kv_heads, quant):
    """To the bit: the rotated q, and the cache (and int8 scales) after the write, from q, k, v
    strided out of a fused projection as the engine makes them."""
    g = torch.Generator().manual_seed(heads)
    T, blocks = 7, 4
    qkv = torch.randn(T, (heads + 2 * kv_heads) * HEAD_DIM, generator=g)
    q, k, v = qkv.split([heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], -1)
    q, k, v = q.view(T, heads, HEAD_DIM), k.view(T, kv_heads, HEAD_DIM), v.view(T, kv_heads, HEAD_DIM)
    k[0, 0, :3] = torch.tensor([127, 2.5, -2.5]) / 64           # int8 rounding ties after rotary at position 0
    freqs = torch.outer(torch.tensor([0, 1, 5, 9, 100, 3000, 17]).float(),
                        1 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    slots = torch.randperm(blocks * PAGE, generator=g)[:T]

    def caches():
        shape, dtype = (blocks, PAGE, kv_heads, HEAD_DIM), torch.int8 if quant else torch.float32
        scale = (lambda: torch.zeros(shape[:3])) if quant else (lambda: None)
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), scale(), scale()
    want_cache, got_cache = caches(), caches()
    want = norm_rope.rotary_store_kv(q, k, v, cos, sin, *want_cache[:2], slots, *want_cache[2:])
    got = cpu_ops().rotary_store_kv(q, k, v, cos, sin, *got_cache[:2], slots, *got_cache[2:])
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache) if a is not None)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("shape", [(1, 896), (5, 96), (3, 4, HEAD_DIM)])    # a row; a tail past 8; q-norm's heads
def test_compiled_cpu_add_rms_norm(shape, with_residual):
    x, res, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    res = res if with_residual else None
    (got, got_h), (want, want_h) = cpu_ops().add_rms_norm(x, res, w, 1e-6), norm_rope.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(got_h, want_h)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 2 * 4864), (5, 2 * 37), (2, 3, 2 * 16)])
def test_compiled_cpu_silu_and_mul(shape):
    from kernels import activation
    x = torch.randn(shape) * 4
    x.view(-1)[:4] = torch.tensor([-100.0, 100.0, 88.0, -90.0])     # exp's range ends
    torch.testing.assert_close(cpu_ops().silu_and_mul(x), activation.silu_and_mul(x), rtol=1e-5, atol=1e-6)


def test_compiled_cpu_kernels_take_the_references_arguments():
    from kernels import layer_cpu
    ops = cpu_ops()
    for name in layer_cpu.KERNELS:
        reference = inspect.unwrap(getattr(kernels, name))
        schema = getattr(ops, name).default._schema
        assert [a.name for a in schema.arguments] == list(inspect.signature(reference).parameters)


def test_dispatcher_runs_the_compiled_cpu_kernels_when_turned_on_for_float32():
    from kernels import activation
    cpu_ops()
    x, calls = torch.randn(3, 2 * HEAD_DIM), []

    def silu_and_mul(t):            # the twin, counting its calls
        calls.append(t.dtype)
        return activation.silu_and_mul(t)
    dispatched = kernels._dispatch(silu_and_mul)
    with kernels.with_cpu_ops(kernels.cpu_ops(True)):
        dispatched(x), dispatched(x.bfloat16())
    assert calls == [torch.bfloat16]            # float32 ran the compiled kernel, bf16 the twin
    dispatched(x)                               # outside the block: the twin
    with kernels.with_cpu_ops(kernels.cpu_ops(False)):
        dispatched(x)
    assert calls == [torch.bfloat16, torch.float32, torch.float32]


# What the attention wrappers launch for Qwen2.5-1.5B's attention (12 heads over 2 KV heads of
# 128, the engine's widest) in float32, the widest dtype (shared memory grows with the tiles'
# bytes; an int8 cache and bf16 take less), compiled for a GPU without one, as Triton's
# launcher specializes it; prints [[kernel, capability, bytes of shared memory], ...].
COMPILE_FOR_GPUS = r"""
import json, torch
from kernels import attention_triton as at, gemv_triton as gt, gguf_quant, gguf_quant_triton as ggt
from kernels import quant_matmul_triton as qt
from kernels.triton_offline import Record as Recorder, compile_launch

launches = []
Record = lambda kernel: Recorder(kernel, launches)
for name in ("_decode_kernel", "_combine_kernel", "_prefill_kernel"):
    setattr(at, name, Record(getattr(at, name)))
for name in ("_gemv_kernel", "_gemv_reduce_kernel"):
    setattr(gt, name, Record(getattr(gt, name)))
ggt._gguf_kernel, ggt._gemv_reduce_kernel = Record(ggt._gguf_kernel), gt._gemv_reduce_kernel
qt._fp8_rows_kernel = Record(qt._fp8_rows_kernel)

q, cache = torch.zeros(2, 12, 128), torch.zeros(4, 16, 2, 128)
tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([20, 9])
for splits in (1, 4):
    at.paged_decode_attention(q, cache, cache, tables, lens, 0.1, num_splits=splits)
at.paged_prefill_attention(q, cache, cache, tables, lens, torch.tensor([0, 1, 2]), 0.1)
# The GEMV in bf16 as planned for a 132-SM chip: the 1.5B's q|k|v at 1 and 64 rows (slices of K).
gt.programs_to_fill = lambda device: 264
w, b = torch.zeros(1536, 2048, dtype=torch.bfloat16), torch.zeros(2048, dtype=torch.bfloat16)
for M in (1, 64):
    gt.gemv_linear(torch.zeros(M, 1536, dtype=torch.bfloat16), w, b)
# And on int8 and e4m3 weights with their scales (quantized layers' GEMV).
for dtype in (torch.int8, torch.float8_e4m3fn):
    gt.gemv_linear(torch.zeros(1, 1536, dtype=torch.bfloat16), w.to(dtype), b, torch.ones(2048))
# fp8's activations, a row per program, at the 1.5B's hidden size and its down projection's input.
for M, K in ((1, 1536), (64, 8960)):
    qt.quantize_fp8(torch.zeros(M, K, dtype=torch.bfloat16))
# The GGUF kernel on each file type's blocks and each GPU layout at the 1.5B's q|k|v, at 1 and 16 rows.
for qtype in gguf_quant.FILE_TYPES + tuple(gguf_quant.PLANAR):
    blocks = torch.zeros(2048, gguf_quant.row_bytes(qtype, 1536), dtype=torch.uint8)
    for M in (1, 16):
        ggt.gguf_matmul(torch.zeros(M, 1536, dtype=torch.bfloat16), blocks, qtype)

def shared(kernel, args, kwargs, capability):
    return compile_launch(kernel, args, kwargs, capability).metadata.shared

def capabilities(args):       # e4m3 is Ada's and Hopper's (sm_89 on), as the engine's fp8 is
    return (90,) if any(isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn for v in args) else (90, 86)
print(json.dumps([[k.fn.__name__, cap, shared(k, a, kw, cap)]
                  for k, a, kw in launches for cap in capabilities(a)]))
"""


@triton_only
def test_triton_kernels_fit_in_the_shared_memory_of_hopper_and_consumer_gpus():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPUS], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parents[1], env=env)
    if out.returncode and "Cannot find ptxas" in out.stderr:   # a Triton without its CUDA tools
        pytest.skip("no ptxas to compile for a GPU with")
    assert out.returncode == 0, out.stderr
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted({kernel for kernel, _, _ in sizes}) == ["_combine_kernel", "_decode_kernel", "_fp8_rows_kernel",
                                                         "_gemv_kernel", "_gemv_reduce_kernel", "_gguf_kernel",
                                                         "_prefill_kernel"]
    # Per block: 227 KB on Hopper (sm_90), 99 KB on sm_86 and sm_89.
    limit = {90: 227 * 1024, 86: 99 * 1024}
    assert [s for s in sizes if s[2] > limit[s[1]]] == []


# ---- the dispatcher ----

@triton_only
@pytest.mark.parametrize("name", kernels.__all__)
def test_triton_twin_takes_the_references_arguments(name):
    reference = inspect.unwrap(getattr(kernels, name))
    twin = getattr(importlib.import_module(reference.__module__ + "_triton"), name)
    ref_params = [(p.name, p.default) for p in inspect.signature(reference).parameters.values()]
    twin_params = [(p.name, p.default) for p in inspect.signature(twin).parameters.values()]
    assert twin_params[:len(ref_params)] == ref_params
    assert all(default is not inspect.Parameter.empty for _, default in twin_params[len(ref_params):])


@triton_only
def test_dispatcher_runs_triton_when_asked_and_the_reference_on_cpu(monkeypatch):
    from kernels import activation_triton
    x = torch.randn(3, 2 * HEAD_DIM)
    calls = []
    monkeypatch.setattr(activation_triton, "_silu_and_mul_kernel", _Spy(activation_triton._silu_and_mul_kernel, calls))
    kernels.silu_and_mul(x)
    assert calls == []
    monkeypatch.setattr(kernels, "_use_triton", lambda t: True)
    kernels.silu_and_mul(x)
    assert len(calls) == 1


class _Spy:
    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def test_kernels_import_and_run_on_cpu_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"   # makes `import triton` fail
            "import torch, kernels\n"
            "assert not kernels.HAS_TRITON\n"
            "x = torch.randn(2, 8)\n"
            "print(kernels.add_rms_norm(x, None, torch.ones(8), 1e-6)[0].shape)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
