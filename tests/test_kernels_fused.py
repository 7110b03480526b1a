"""The fused kernels, rotary_store_kv and silu_and_mul: their references against the unfused ops
they replace in the engine (exactly, float32 and bf16), then their Triton twins against the
references on CPU under TRITON_INTERPRET=1 (set in conftest), in float32 because the interpreter
gets bf16 wrong (see docs/kernels.md). Every output starts poisoned so an element a kernel
leaves unwritten shows."""
import math
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import activation, attention, norm_rope
from tests.test_kernels import _Spy

PAGE = 8
# Query / KV heads: GQA groups of 2, 6 (Qwen2.5-1.5B) and 7 (Qwen2.5-0.5B), and plain MHA.
HEADS = [(4, 2), (12, 2), (14, 2), (8, 8)]

triton_only = pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")


@dataclass
class Step:
    qkv: torch.Tensor            # [T, (heads + 2 * kv_heads) * d], one fused projection
    q: torch.Tensor              # [T, heads, d], k and v [T, kv_heads, d]: views of qkv
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor            # [T, 1, d / 2], as engine.model.Rotary gives them
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    cache_shape: tuple[int, ...]
    quant: bool

    def caches(self) -> dict:
        """Fresh caches, and scales when int8, filled with what no write leaves: NaN, and for
        int8 -128 (quantize_kv clamps to +-127) with scale -1."""
        shape = self.cache_shape
        if not self.quant:
            return {name: torch.full(shape, math.nan, dtype=self.qkv.dtype) for name in ("k_cache", "v_cache")}
        return {**{name: torch.full(shape, -128, dtype=torch.int8) for name in ("k_cache", "v_cache")},
                **{name: torch.full(shape[:3], -1.0) for name in ("k_scale", "v_scale")}}


def make_step(T: int, heads: int, kv_heads: int, head_dim: int, quant: bool, dtype=torch.float32,
              seed: int = 0) -> Step:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim)
    angles = torch.rand(T, 1, head_dim // 2, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    # Token 0 at angle 0 keeps its key, whose first three values are exact int8 rounding ties
    # (scale 1/64), as are its value's.
    cos[0], sin[0] = 1.0, 0.0
    for x in (k, v):
        x[0, 0] = x[0, 0].clamp(-1.9, 1.9)
        x[0, 0, :3] = torch.tensor([127, 2.5, -2.5]) / 64
    # Every slot of a few blocks, shuffled: the step's tokens land across blocks and out of order.
    num_blocks = -(-T // PAGE) + 2
    slot_mapping = torch.randperm(num_blocks * PAGE, generator=g)[:T]
    return Step(qkv, q, k, v, cos, sin, slot_mapping, (num_blocks, PAGE, kv_heads, head_dim), quant)


def nan_empty(fn, *args, **kwargs):
    """fn's result with every float tensor it allocates with torch.empty starting as NaN."""
    empty = torch.empty

    def poisoned(*a, **kw):
        t = empty(*a, **kw)
        return t.fill_(math.nan) if t.is_floating_point() else t
    with mock.patch.object(torch, "empty", poisoned):
        return fn(*args, **kwargs)


# ---- the references against the unfused ops they replace ----

@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_kv_reference_equals_rotary_then_store_kv(dtype, quant):
    s = make_step(37, 12, 2, 64, quant, dtype)
    want, got = s.caches(), s.caches()
    q = norm_rope.apply_rotary(s.q, s.cos, s.sin)
    attention.store_kv(norm_rope.apply_rotary(s.k, s.cos, s.sin), s.v, **want, slot_mapping=s.slot_mapping)
    fused = norm_rope.rotary_store_kv(s.q, s.k, s.v, s.cos, s.sin, **got, slot_mapping=s.slot_mapping)
    assert fused.dtype == dtype and torch.equal(fused, q)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_reference_equals_silu_times_up(dtype):
    x = torch.randn(5, 2 * 96).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    got = activation.silu_and_mul(x)
    assert got.dtype == dtype and torch.equal(got, F.silu(gate) * up)


# ---- the Triton twins against their references (interpreted) ----

@triton_only
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("T", [1, 3, 37])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_rotary_store_kv(head_dim, heads, kv_heads, T, quant):
    from kernels import norm_rope_triton
    s = make_step(T, heads, kv_heads, head_dim, quant, seed=T)
    inputs = s.qkv.clone()
    want, got = s.caches(), s.caches()
    want_q = norm_rope.rotary_store_kv(s.q, s.k, s.v, s.cos, s.sin, **want, slot_mapping=s.slot_mapping)
    got_q = nan_empty(norm_rope_triton.rotary_store_kv, s.q, s.k, s.v, s.cos, s.sin, **got,
                      slot_mapping=s.slot_mapping)
    assert got_q.shape == (T, heads, head_dim) and got_q.is_contiguous()
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    if quant:
        for name in want:
            assert torch.equal(got[name], want[name]), name
    else:
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.equal(s.qkv, inputs)


@triton_only
@pytest.mark.parametrize("I", [96, 4864])
@pytest.mark.parametrize("T", [1, 5, 300])
def test_triton_silu_and_mul(T, I):
    from kernels import activation_triton
    x = torch.randn(T, 2 * I)
    got = nan_empty(activation_triton.silu_and_mul, x)
    assert got.shape == (T, I)
    torch.testing.assert_close(got, activation.silu_and_mul(x), rtol=1e-6, atol=1e-6)


@triton_only
def test_triton_silu_and_mul_over_several_column_blocks():
    from kernels import activation_triton
    x = torch.randn(3, 2 * 96)
    # Blocks of 64 over 96 columns: one full block and a masked tail per row.
    got = nan_empty(activation_triton.silu_and_mul, x, block_n=64)
    torch.testing.assert_close(got, activation.silu_and_mul(x), rtol=1e-6, atol=1e-6)


@triton_only
def test_the_fused_kernels_are_one_launch_each_through_the_dispatcher(monkeypatch):
    from kernels import activation_triton, norm_rope_triton
    launches = []
    monkeypatch.setattr(kernels, "_use_triton", lambda t: True)
    monkeypatch.setattr(norm_rope_triton, "_rotary_store_kv_kernel",
                        _Spy(norm_rope_triton._rotary_store_kv_kernel, launches))
    monkeypatch.setattr(activation_triton, "_silu_and_mul_kernel",
                        _Spy(activation_triton._silu_and_mul_kernel, launches))
    s = make_step(3, 12, 2, 128, quant=True)
    kernels.rotary_store_kv(s.q, s.k, s.v, s.cos, s.sin, **s.caches(), slot_mapping=s.slot_mapping)
    assert launches == [(3,)]
    kernels.silu_and_mul(torch.randn(3, 2 * 96))
    assert launches == [(3,), (3, 1)]
