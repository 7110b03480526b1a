"""Weight-only quantization: the shared formats round-trip, the CPU ops agree with plain
dequantized math, and a quantized engine still follows its float model."""
import json

import pytest
import torch

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.model import Linear, load_model
from engine.quantize import (
    DEQUANT_ROWS,
    QuantLinear,
    apply_gemv_buckets,
    bucket_ways,
    dequant_rows_default,
    dequantize,
    dot_matmul,
    fp8_scaled_mm,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from engine.sampling_params import SamplingParams
from kernels import gemv
from kernels.cpu_build import vnni
from kernels.quant_matmul import fp8_matmul, int4_int8_matmul, int4_matmul, int8_int8_matmul
from kernels.quant_matmul import quantize_fp8 as fp8_rows
from tests.conftest import make_tiny_model, quantized

NO_DOT = "no integer dot products on this CPU (no VNNI, and the AVX2 kernels cannot be built here)"


def test_int8_round_trip_error_is_within_half_a_step():
    w = torch.randn(48, 96)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_and_packing(group):
    w = torch.randn(16, 256)
    packed, s, z = quantize_int4(w, group)
    assert packed.shape == (16, 128) and packed.dtype == torch.uint8
    q = unpack_int4(packed).float().view(16, 256 // group, group)
    deq = ((q - z[..., None]) * s[..., None]).view(16, 256)
    step = s.repeat_interleave(group, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-5).all()


@pytest.mark.parametrize("mode", ["int8", "int8-dot", "int4", "int4-dot"])
def test_cpu_quant_linear_matches_dequantized_math(mode):
    kind, dot = mode.removesuffix("-dot"), mode.endswith("-dot")
    if dot and dot_matmul(kind, 32) is None:
        pytest.skip(NO_DOT)
    w, b, x = torch.randn(64, 128), torch.randn(64), torch.randn(5, 128)
    tensors, deq = quantized(w, kind, 32)
    layer = QuantLinear(kind, tensors, b, 32, dot_rows=int(dot))
    assert layer.dot_rows == dot
    got = layer(x)
    want = x @ deq.T + b
    # bf16 activations and scales, or int8 activations: about three significant digits.
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.02)


def test_int8_over_many_rows_multiplies_dequantized_in_float32():
    """From `dequant_rows` rows on, an int8 layer on the CPU multiplies in float32 over its
    dequantized weights (slice by slice, the slices spanning several rows here): exact to
    float32 rounding, where the packed op below that keeps its bf16 activations' error."""
    torch.manual_seed(0)
    w, b = torch.randn(3000, 512), torch.randn(3000)
    q, s = quantize_int8(w)
    layer = QuantLinear("int8", {"w": q, "scales": s}, b, 32, dequant_rows=4)
    deq = q.float() * s.to(torch.bfloat16).float()[:, None]       # the layer keeps bf16 scales
    for rows, tol in ((4, 1e-5), (3, 1e-3)):
        x = torch.randn(rows, 512)
        err = (layer(x) - (x @ deq.T + b)).abs().max().item() / (x @ deq.T).abs().max().item()
        assert err < tol if rows >= 4 else tol < err < 0.02
    # Only the CPU's packed int4 layout has no stored format left to dequantize; int4 on dot
    # products keeps it.
    assert QuantLinear("int8", {"w": q, "scales": s}, b, 32, packed=False, dequant_rows=4).dequant_rows == 4
    q4, s4, z4 = quantize_int4(w[:64], 32)
    assert QuantLinear("int4", {"w": q4, "scales": s4, "zeros": z4}, b[:64], 32, dequant_rows=4).dequant_rows == 0
    if dot_matmul("int4", 32) is not None:
        layer = QuantLinear("int4", {"w": q4, "scales": s4, "zeros": z4}, b[:64], 32, dequant_rows=4, dot_rows=4)
        assert (layer.dequant_rows, layer.dot_rows, layer.packed) == (4, 1, False)


def test_int8_runs_packed_then_on_dot_products_then_dequantized_as_rows_grow():
    if dot_matmul("int8", 32) is None:
        pytest.skip(NO_DOT)
    torch.manual_seed(0)
    q, s = quantize_int8(torch.randn(64, 128))
    layer = QuantLinear("int8", {"w": q, "scales": s}, None, 32, dequant_rows=6, dot_rows=4)
    x = torch.randn(6, 128)
    torch.testing.assert_close(layer(x[:4]), int8_int8_matmul(x[:4], q, s, layer.block), rtol=1e-5, atol=1e-5)
    packed = QuantLinear("int8", {"w": q, "scales": s}, None, 32)
    torch.testing.assert_close(layer(x[:3]), packed(x[:3]), rtol=0, atol=0)
    dequantized = QuantLinear("int8", {"w": q, "scales": s}, None, 32, dequant_rows=6)
    torch.testing.assert_close(layer(x), dequantized(x), rtol=0, atol=0)


def test_int4_runs_on_dot_products_then_dequantized_as_rows_grow():
    """int4 on dot products keeps the stored format: below dequant_rows its twin's integer sums
    (the groups summed in float32 in another order), from there the float32 reference exactly."""
    if dot_matmul("int4", 32) is None:
        pytest.skip(NO_DOT)
    torch.manual_seed(0)
    q, s, z = quantize_int4(torch.randn(96, 256), 32)
    b = torch.randn(96)
    layer = QuantLinear("int4", {"w": q, "scales": s, "zeros": z}, b, 32, dequant_rows=6, dot_rows=1)
    x = torch.randn(6, 256)
    torch.testing.assert_close(layer(x[:5]), int4_int8_matmul(x[:5], q, s, z, 32) + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), int4_matmul(x, q, s, z, 32) + b, rtol=0, atol=0)


def test_prompts_dequantize_unless_the_compiled_integer_kernels_serve_them():
    """The default dequant_rows: 0 (the integer kernels at every row) only where a prompt's matmuls
    would run on the compiled AVX2 kernels; with dot products off, under VNNI's `_int_mm` and on
    CUDA the measured DEQUANT_ROWS."""
    assert dequant_rows_default("cuda", "int8", 128, 0) == DEQUANT_ROWS["cuda"]
    for mode in ("int8", "int4"):
        assert dequant_rows_default("cpu", mode, 128, 0) == DEQUANT_ROWS["cpu"]
        compiled = dot_matmul(mode, 128) not in (None, int8_int8_matmul)
        assert dequant_rows_default("cpu", mode, 128, 1) == (0 if compiled else DEQUANT_ROWS["cpu"])


@pytest.mark.parametrize("block", [0, 32, 128])
def test_integer_dot_products_sum_the_rounded_activations_exactly(block):
    """int8_int8_matmul: the int32 sums of the activations rounded per row (block 0) or per block
    times the weights are exact (against float64 math on the same rounding), and the result stays
    within the activations' rounding of the dequantized float product."""
    torch.manual_seed(0)
    w, x = torch.randn(96, 256), torch.randn(7, 256) * torch.logspace(-2, 2, 7)[:, None]
    q, s = quantize_int8(w)
    got = int8_int8_matmul(x, q, s, block)
    xb = x.view(7, -1, block or 256)
    x_scale = xb.abs().amax(-1, keepdim=True) / 127
    ints = (xb / x_scale).round().double()                       # [7, blocks, block]
    sums = torch.einsum("mgk,ngk->mng", ints, q.double().view(96, -1, block or 256))
    exact = (sums * x_scale.double().view(7, 1, -1)).sum(-1) * s.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)
    want = x @ (q.float() * s[:, None]).T
    assert ((got - want).abs().amax(1) / want.abs().amax(1)).max() < 0.02


def test_an_activation_outlier_costs_only_its_own_block():
    """One scale per row lets a single large activation (Qwen2.5's intermediate activations have
    a few 100x the rest) round the rest of its row to a few levels; with a scale per block of 128
    the other blocks keep their precision."""
    torch.manual_seed(0)
    q, s = quantize_int8(torch.randn(64, 1024))
    x = torch.randn(4, 1024)
    x[:, 5] = 300.0
    want = x @ (q.float() * s[:, None]).T
    err = {b: (int8_int8_matmul(x, q, s, b) - want).norm() / want.norm() for b in (0, 128)}
    assert err[128] < err[0] / 2.5     # one block of eight rounds coarsely: about sqrt(8) less


def test_bad_quant_config_is_rejected():
    with pytest.raises(ValueError, match="quant must be"):
        ModelEntry("x", quant="int3")
    with pytest.raises(ValueError, match="group_size"):
        ModelEntry("x", quant="int4", group_size=48)
    with pytest.raises(ValueError, match="dequant_rows"):
        ModelEntry("x", quant="int8", dequant_rows=-1)


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8"])
def test_quantized_engine_stays_close_to_float(tmp_path, mode, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_model(tmp_path / "m", "qwen2", seed=3)
    prompt = torch.randint(0, 127, (40,)).tolist()

    def engine(quant, dequant_rows=None, dot_rows=None):
        entry = ModelEntry(str(folder), quant=quant, group_size=32, dequant_rows=dequant_rows, dot_rows=dot_rows)
        return LLMEngine(EngineConfig(models={"m": entry}, max_kv_blocks=64, block_size=4, memory_budget_gb=1.0),
                         progress=False)

    ref = engine("none").generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    got = engine(mode).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert list((tmp_path / "cache" / "derived").glob(f"*/{mode}-g32.safetensors"))
    again = engine(mode).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert again.token_ids == got.token_ids          # the cached quantized weights are the same
    if mode == "fp8":
        # Weights and activations in e4m3 (the float32 emulation on the CPU, every row count):
        # the random model's first greedy token holds, its log-probability within 0.1.
        assert got.token_ids[0] == ref.token_ids[0] and abs(got.logprobs[0] - ref.logprobs[0]) < 0.1
        stats = engine(mode).stats()["m"]
        assert (stats["quant"], stats["dequant_rows"], stats["dot_rows"], stats["dense_buckets"],
                stats["gemv_buckets"]) == ("fp8", 0, 0, [], {})
    if mode == "int8":
        # Per-channel int8 is close enough that the first greedy token of a random model holds,
        # whether the 40-token prefill runs on the packed op or dequantized (from 4 rows).
        for rows in (0, 4):
            e = engine(mode, dequant_rows=rows)
            got = e.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
            assert got.token_ids[0] == ref.token_ids[0]
            assert abs(got.logprobs[0] - ref.logprobs[0]) < 0.1
            assert e.stats()["m"]["dequant_rows"] == rows
    if dot_matmul(mode, 32) is None:
        return
    # Every matmul on integer dot products (int8 activations), against the same weights in
    # float32: the float model for int8; for int4, whose own rounding moves this random model's
    # first token, its weights dequantized (every row count dequantizes).
    base = ref if mode == "int8" else engine(mode, dequant_rows=1, dot_rows=0).generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    e = engine(mode, dequant_rows=0, dot_rows=1)
    got = e.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert got.token_ids[0] == base.token_ids[0] and abs(got.logprobs[0] - base.logprobs[0]) < 0.1
    assert e.stats()["m"]["dot_rows"] == 1
    assert e.stats()["m"]["dot_vnni"] == (vnni() and dot_matmul(mode, 32) is not int8_int8_matmul)


@pytest.mark.parametrize("mode", ["float", "int8", "int4", "int8-unpacked", "int4-unpacked", "int8-dot", "int4-dot"])
def test_rows_compute_those_outputs_of_the_layer(mode):
    if mode.endswith("-dot") and dot_matmul(mode.removesuffix("-dot"), 32) is None:
        pytest.skip(NO_DOT)
    """A drafter's smaller head: the layer restricted to some outputs (whole row blocks, as
    torch's packed int4 layout needs: 32 rows under AVX2, 64 under AVX-512) gives exactly the
    full layer's values there."""
    torch.manual_seed(0)
    w, x = torch.randn(256, 64), torch.randn(3, 64)
    if mode == "float":
        layer = Linear(64, 256, bias=False)
        layer.weight_t = torch.nn.Parameter(w.t().contiguous(), requires_grad=False)
    else:
        kind = mode.removesuffix("-unpacked").removesuffix("-dot")
        tensors = dict(zip(("w", "scales"), quantize_int8(w))) if kind == "int8" else \
            dict(zip(("w", "scales", "zeros"), quantize_int4(w, 32)))
        layer = QuantLinear(kind, tensors, None, 32, packed=not mode.endswith("unpacked"),
                            dot_rows=int(mode.endswith("dot")))
    b = max(layer.row_block, 32)
    ids = torch.cat([torch.arange(0, b), torch.arange(256 - b, 256)])
    torch.testing.assert_close(layer.rows(ids)(x), layer(x)[:, ids], rtol=0, atol=1e-5)


# fp8: float8 e4m3 weights per output channel, activations per token (row).
E4M3_HALF_STEP = 2.0 ** -4          # round to nearest with 3 stored mantissa bits: half a step, relative
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10       # below 2**-6 the step is 2**-9 (absolute, before scaling)


def _fp8_rounding_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How far e4m3 rounding may move each value of v (scaled by `scale` per row)."""
    return E4M3_HALF_STEP * v.abs() + E4M3_SUBNORMAL_HALF_STEP * scale


def test_fp8_rounds_each_row_to_its_largest_value_at_448_and_leaves_zero_rows_zero():
    torch.manual_seed(0)
    x = torch.randn(6, 96) * torch.logspace(-6, 3, 6)[:, None]
    x[3] = 0
    q, scale = fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert scale[3].item() == 1 and (q[3].float() == 0).all()          # no 0 / 0
    deq = q.float() * scale
    assert torch.allclose(q.float().abs().amax(1)[[0, 1, 2, 4, 5]], torch.full((5,), 448.0))
    assert ((deq - x).abs() <= _fp8_rounding_bound(x, scale) * (1 + 1e-6)).all()
    wq, wscale = quantize_fp8(torch.randn(32, 96))              # weights: the same rounding per output channel
    assert wq.dtype == torch.float8_e4m3fn and wscale.shape == (32,)


def test_fp8_matmul_emulates_the_rounded_operands_exactly_up_to_float32_sums():
    """fp8_matmul against a straightforward computation of the same rounding: the e4m3 products
    summed exactly (float64 holds every sum of them here), times both scales. They differ only by
    float32's accumulation, bounded by K * 2**-24 times the sum of the products' magnitudes."""
    torch.manual_seed(0)
    w, x = torch.randn(80, 512), torch.randn(9, 512) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0
    wq, ws = quantize_fp8(w)
    xq, xs = fp8_rows(x)
    got = fp8_matmul(x, wq, ws)
    exact = (xq.double() @ wq.double().T) * xs.double() * ws.double()
    slack = 512 * 2.0 ** -24 * (xq.double().abs() @ wq.double().abs().T) * xs.double() * ws.double()
    assert ((got.double() - exact).abs() <= slack + 1e-30).all()
    assert (got[4] == 0).all()


def test_fp8_layer_stays_within_e4m3_rounding_of_the_unquantized_layer():
    """Against x @ w.T in float32, each product's error is bounded by both operands' rounding:
    |x^ w^ - x w| <= |x^ - x| |w^| + |x| |w^ - w|, with |v^ - v| <= 2**-4 |v| + 2**-10 scale;
    summed over k that is the bound checked per output. On Gaussian data the relative error of
    the whole output comes out near 4% (each operand's rounding about 2.6% rms)."""
    torch.manual_seed(1)
    w, b, x = torch.randn(128, 256) / 16, torch.randn(128), torch.randn(7, 256)
    wq, ws = quantize_fp8(w)
    layer = QuantLinear("fp8", {"w": wq, "scales": ws}, b, 128)
    assert not layer.packed and layer.dot is None and not layer.scaled_mm       # the CPU: the emulation
    got = layer(x) - b
    want = x @ w.T
    w_err, x_err = _fp8_rounding_bound(w, ws[:, None]), _fp8_rounding_bound(x, fp8_rows(x)[1])
    bound = x_err @ (w.abs() + w_err).T + x.abs() @ w_err.T
    assert ((got - want).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    assert 0.01 < ((got - want).norm() / want.norm()).item() < 0.06


def test_fp8_scaled_mm_takes_the_operands_as_the_emulation_does():
    """The call the GPU makes (torch._scaled_mm with row-wise scales, bf16 out) runs on the CPU
    too: on the same operands it equals the emulation to bf16's rounding, which checks the
    layout and scales it is handed. (Its speed, and its FP8 tensor cores, only a GPU measures.)"""
    torch.manual_seed(2)
    w, x = torch.randn(64, 128), torch.randn(5, 128)
    wq, ws = quantize_fp8(w)
    want = fp8_matmul(x, wq, ws)
    got = fp8_scaled_mm(x, wq, ws)
    assert ((got - want).abs() <= 2.0 ** -8 * want.abs() + 1e-6).all()


def test_fp8_layer_dequantizes_weights_only_and_restricts_to_rows():
    torch.manual_seed(3)
    w, x = torch.randn(96, 64), torch.randn(6, 64)
    wq, ws = quantize_fp8(w)
    layer = QuantLinear("fp8", {"w": wq, "scales": ws}, None, 128, dequant_rows=6)
    torch.testing.assert_close(layer(x), x @ (wq.float() * ws[:, None]).T, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(layer(x[:5]), fp8_matmul(x[:5], wq, ws), rtol=0, atol=0)
    ids = torch.tensor([0, 5, 17, 95])
    torch.testing.assert_close(layer.rows(ids)(x[:2]), layer(x[:2])[:, ids], rtol=0, atol=0)
    assert dequant_rows_default("cuda", "fp8", 128, 0) == 0 and dequant_rows_default("cpu", "fp8", 128, 1) == 0
    assert dot_matmul("fp8", 128) is None


def test_dense_buckets_add_the_bias_in_the_matmul():
    """Row counts the bucket table sends to the dense weights take the bias in the same call (on
    CUDA in cuBLAS's epilogue, not a kernel of its own): x times the dequantized weights plus the
    bias, which for int8 and int4 is also what their own path computes (fp8's quantizes x too)."""
    torch.manual_seed(4)
    w, bias = torch.randn(48, 64), torch.randn(48)
    for mode, names, quantize in (("int8", ("w", "scales"), quantize_int8), ("fp8", ("w", "scales"), quantize_fp8),
                                  ("int4", ("w", "scales", "zeros"), lambda w: quantize_int4(w, 32))):
        tensors, group = dict(zip(names, quantize(w))), 32 if mode == "int4" else 128
        dense = QuantLinear(mode, tensors, bias, group, packed=False, ways=("kernel", "dense", "kernel", "dense"))
        plain = QuantLinear(mode, tensors, bias, group, packed=False)
        for rows in (1, 3):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(dense(x), x @ dequantize(mode, tensors, group).T + bias, rtol=1e-5, atol=1e-5)
            if mode != "fp8":
                torch.testing.assert_close(dense(x), plain(x), rtol=1e-5, atol=1e-5)


def test_bucket_table_picks_per_row_count_from_the_smallest_bucket_at_or_above_it(tmp_path):
    table = tmp_path / "buckets.json"
    assert bucket_ways("int8", "GPU A", table) == ()                # no file: today's behaviour
    table.write_text(json.dumps({"devices": {"GPU A": {"buckets": {
        "int4": {"1": "kernel", "8": "kernel", "16": "dense", "64": "dense"},
        "int8": {"1": "dense", "2": "gemv", "4": "kernel"}}}}}))
    picks = bucket_ways("int4", "GPU A", table)
    assert len(picks) == 65
    assert set(picks[:9]) == {"kernel"} and set(picks[9:]) == {"dense"}     # 9..16 pad to 16's graph
    assert bucket_ways("int8", "GPU A", table) == ("dense", "dense", "gemv", "kernel", "kernel")
    assert bucket_ways("fp8", "GPU A", table) == () and bucket_ways("int8", "GPU B", table) == ()
    table.write_text(json.dumps({"devices": {"GPU A": {"buckets": {"int8": {"1": "bf16"}}}}}))
    with pytest.raises(ValueError, match="kernel, dense, gemv"):
        bucket_ways("int8", "GPU A", table)
    table.write_text(json.dumps({"devices": {"GPU A": {"buckets": {"int4": {"1": "gemv"}}}}}))
    with pytest.raises(ValueError, match="kernel, dense; got"):     # the GEMV reads int8 and e4m3 only
        bucket_ways("int4", "GPU A", table)


def test_bf16_layers_run_the_gemv_where_the_table_picks_it_for_their_kind(tmp_path, monkeypatch):
    """A bf16 model's Linears take the Triton GEMV ("kernel") or cuBLAS ("dense") per row count as
    the device's entry for their kind says; a kind, a device or a dtype the table does not name
    stays on the GEMM as built."""
    import engine.model
    folder = make_tiny_model(tmp_path / "m", "qwen2")
    table = tmp_path / "buckets.json"
    table.write_text(json.dumps({"devices": {"GPU A": {"buckets": {
        "bf16.qkv": {"1": "kernel", "2": "kernel", "4": "dense"}, "bf16.o": {"1": "dense", "8": "kernel"},
        "int8": {"1": "dense"}}}}}))
    model = load_model(folder, dtype=torch.bfloat16)
    assert apply_gemv_buckets(model, "GPU B", table) == {}
    assert apply_gemv_buckets(load_model(folder), "GPU A", table) == {}         # float32: no bf16 entry applies
    picks = apply_gemv_buckets(model, "GPU A", table)
    assert picks == {"qkv": (True, True, True, False, False),                   # 3 rows pad to 4's graph
                     "o": (False, False) + (True,) * 7}
    attn = model.layers[1].self_attn
    assert attn.qkv_proj.gemv_rows == picks["qkv"] and attn.o_proj.gemv_rows == picks["o"]
    assert model.layers[0].mlp.down_proj.gemv_rows == () and model.lm_head.gemv_rows == ()
    calls = []
    monkeypatch.setattr(engine.model, "gemv_linear", lambda *a: calls.append(a[0].shape[0]) or gemv.gemv_linear(*a))
    torch.manual_seed(0)
    x = torch.randn(9, attn.qkv_proj.weight_t.shape[0]).to(torch.bfloat16)
    for rows in (1, 2, 3, 4, 9):
        y = attn.qkv_proj(x[:rows])
        want = x[:rows].float() @ attn.qkv_proj.weight_t.float() + attn.qkv_proj.bias.float()
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
    assert calls == [1, 2]                  # 3 and 4 rows on 4's pick (dense); 9 past the table
    attn.o_proj(x[:8])
    assert calls == [1, 2, 8]


def test_gpu_kernels_bf16_picks_reach_the_engines_layers(tmp_path, monkeypatch):
    """benchmarks/gpu_kernels.py's table from a run's timings (made up here: no GPU) picks the GEMV
    per layer kind and bucket only where it was faster over both models' layers, and the engine
    reads those picks back by the same names."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_kernels

    def layer(gemv: dict[int, float]) -> dict:
        return {"rows": {str(r): {"ways": {"bf16 [in,out]": {"us": 5.0}, "bf16 gemv": {"us": us}}}
                         for r, us in gemv.items()}}
    models = {"qwen2.5-coder-0.5b": {"qkv": layer({1: 2.0, 16: 6.0, 256: 1.0}), "o": layer({1: 5.0, 16: 9.0})},
              "qwen2.5-coder-1.5b": {"qkv": layer({1: 2.0, 16: 4.5}), "o": layer({1: 5.0, 16: 1.0})}}
    table = gpu_kernels.bucket_table(models, max_bucket=64)
    assert {q: {b: c["pick"] for b, c in t.items()} for q, t in table.items()} == {
        "bf16.qkv": {"1": "kernel", "16": "dense"},      # 24 x 6.0 + 28 x 4.5 > 52 x 5.0; 256 past the buckets
        "bf16.o": {"1": "dense", "16": "kernel"}}        # a tie stays on cuBLAS
    path = tmp_path / "buckets.json"
    gpu_kernels.record_buckets(table, "GPU A", "run.json", "2.x", path)
    model = load_model(make_tiny_model(tmp_path / "m", "qwen2"), dtype=torch.bfloat16)
    assert apply_gemv_buckets(model, "GPU A", path) == {"qkv": (True, True) + (False,) * 15,
                                                        "o": (False, False) + (True,) * 15}


def test_gpu_kernels_gguf_step_weighs_each_layer_at_its_type_in_the_file(monkeypatch):
    """Issue 52's figure from a run's timings (made up: no GPU): per layer kind, the shipped file's
    types times their layer counts (the 1.5B's down half Q4_K, half Q6_K; its head Q6_K) against
    bf16's faster way times all the layers; a model missing a type's timing gets no figure."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_kernels

    def layer(q4: float, q6: float, dense: float, gemv: float) -> dict:
        return {"rows": {"1": {"ways": {"Q4_K triton": {"us": q4}, "Q6_K triton": {"us": q6},
                                        "bf16 [in,out]": {"us": dense}, "bf16 gemv": {"us": gemv}}}}}
    models = {"qwen2.5-coder-1.5b": {"qkv": layer(2, 9, 5, 4), "o": layer(2, 9, 4, 5), "gate_up": layer(6, 9, 16, 15),
                                     "down": layer(4, 8, 12, 13), "lm_head": layer(40, 50, 106, 110)},
              "qwen2.5-coder-0.5b": {"qkv": layer(1, 1, 1, 1)}}      # no Q5_0 timings
    step = gpu_kernels.gguf_step(models)
    gguf = 28 * (2 + 2 + 6) + 14 * 4 + 14 * 8 + 50
    bf16 = 28 * (4 + 4 + 15 + 12) + 106
    assert step == {"qwen2.5-coder-1.5b": {"rows": 1, "gguf_us": gguf, "bf16_us": bf16, "speedup": bf16 / gguf}}


def test_gpu_kernels_quantized_picks_weigh_kernel_dense_and_gemv_and_reach_the_engines_layers(tmp_path, monkeypatch):
    """Per int8 bucket, the fastest of the Triton kernel, dense bf16 and the GEMV on int8 bytes,
    summed over the layers (timings made up: no GPU); a GEMV not measured at some layer is not a
    candidate there; the engine's layers read the picks back."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_kernels

    def layer(rows: dict[int, tuple[float, float, float | None]]) -> dict:
        return {"rows": {str(r): {"ways": {"int8 triton": {"us": k}, "bf16 [out,in]": {"us": d}}
                                  | ({"int8 gemv": {"us": g}} if g is not None else {})}
                         for r, (k, d, g) in rows.items()}}
    models = {"qwen2.5-coder-1.5b": {"qkv": layer({1: (6.0, 5.0, 3.0), 16: (5.0, 6.0, 5.5), 32: (9.0, 6.0, None)}),
                                     "o": layer({1: (6.0, 5.0, 3.0), 16: (5.0, 6.0, 5.5), 32: (9.0, 6.0, 1.0)})}}
    table = gpu_kernels.bucket_table(models, max_bucket=64)["int8"]
    assert {b: c["pick"] for b, c in table.items()} == {"1": "gemv", "16": "kernel", "32": "dense"}
    assert "gemv_us" not in table["32"] and table["1"]["gemv_us"] == 28 * 6.0
    path = tmp_path / "buckets.json"
    gpu_kernels.record_buckets({"int8": table}, "GPU A", "run.json", "2.x", path)
    assert bucket_ways("int8", "GPU A", path) == ("gemv", "gemv") + ("kernel",) * 15 + ("dense",) * 16


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8"])
def test_quant_layer_runs_dense_where_its_table_says_and_its_kernel_elsewhere(mode):
    """Row counts the table marks dense multiply on the weights dequantized once (exactly
    x @ deq.T); the others run the precision's own kernel; past the table, dequant_rows decides."""
    torch.manual_seed(4)
    w, b, x = torch.randn(64, 128), torch.randn(64), torch.randn(12, 128)
    tensors = {"w": quantize_fp8(w)[0], "scales": quantize_fp8(w)[1]} if mode == "fp8" else quantized(w, mode, 32)[0]
    deq = dequantize(mode, tensors, 32)
    ways = ("kernel", "kernel", "dense", "dense", "kernel")     # rows 2 and 3 dense
    layer = QuantLinear(mode, tensors, b, 32, ways=ways, dequant_rows=10)
    kernel = QuantLinear(mode, tensors, b, 32)
    assert layer.dense_w is not None and kernel.dense_w is None
    for rows in (1, 4, 5):
        torch.testing.assert_close(layer(x[:rows]), kernel(x[:rows]), rtol=0, atol=0)
    for rows in (2, 3):
        torch.testing.assert_close(layer(x[:rows]), x[:rows] @ deq.T + b, rtol=1e-6, atol=1e-5)
    # Past the table, dequant_rows as before: the dense copy where the layer dequantizes at all
    # (the CPU's packed int4 keeps no stored format, so it never does).
    assert layer.dequant_rows == (0 if mode == "int4" and layer.packed else 10)
    for rows in (10, 12):
        want = x[:rows] @ deq.T + b if layer.dequant_rows else kernel(x[:rows])
        torch.testing.assert_close(layer(x[:rows]), want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(layer(x[:9]), kernel(x[:9]), rtol=0, atol=0)
