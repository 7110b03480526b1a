"""The gguf precision: a GGUF's own quantized blocks kept as stored, read bit-exactly
(kernels/gguf_quant.py against gguf.quants), computed on by the compiled kernel
(kernels/csrc/gguf_linear.cpp against its twin), and served by the engine."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, ModelEntry, SamplingParams, config, worker
from engine.model_runner import Device
from engine.quantize import GGUFLinear
from kernels import cpu_build, gguf_cpu, gguf_quant, quant_matmul
from models import convert
from models.store import StoreError, cache_dir, resolve
from tests.test_kernels import needs_triton, triton_only
from tests.test_store import tmp_cache, write_tiny_gguf


def compiled():
    """The compiled kernel (a build that fails where it could build stops the run: conftest.py)."""
    ops = gguf_cpu.load()
    if ops is None:
        pytest.skip(f"the compiled CPU kernels are not built here ({cpu_build.unable()})")
    return ops


@pytest.mark.parametrize("qtype", gguf_quant.FILE_TYPES)
def test_dequantize_equals_gguf_to_the_bit(qtype):
    w = gguf_quant.random_blocks(qtype, 6, 512)
    ours = gguf_quant.dequantize(w, qtype, 512).numpy()
    theirs = gguf_dequantize(w.numpy(), GGMLQuantizationType[qtype]).reshape(6, 512)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    layout, repacked = gguf_quant.repack(qtype, w)        # the CPU kernel's layout holds the same values
    assert layout == gguf_quant.LAYOUTS.get(qtype, qtype)
    ours = gguf_quant.dequantize(repacked, layout, 512).numpy()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    layout, planes = gguf_quant.to_planes(qtype, w)       # and the GPU's, its rows 16-byte multiples
    assert layout == gguf_quant.GPU_LAYOUTS.get(qtype, qtype)
    assert planes.shape[1] == gguf_quant.row_bytes(layout, 512) and (layout == qtype or planes.shape[1] % 16 == 0)
    ours = gguf_quant.dequantize(planes, layout, 512).numpy()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_a_layer_on_the_gpus_layouts_merges_them_and_multiplies_their_values():
    """GGUFLinear as apply_gguf builds it on a GPU (Q6_K and Q8_0 in planes, Q4_K as stored), here
    on the CPU, where the compiled kernel does not read the GPU's layouts and the weights are
    dequantized instead: consecutive parts of a layout merge, and the outputs are the file's
    blocks' dequantized products; rows() keeps the layout."""
    file = [(t, gguf_quant.random_blocks(t, rows, 512, seed))
            for seed, (t, rows) in enumerate([("Q4_K", 8), ("Q6_K", 16), ("Q6_K", 4), ("Q8_0", 8)])]
    layer = GGUFLinear([gguf_quant.to_planes(t, w) for t, w in file], None)
    assert layer.types == ["Q4_K", "Q6_Kg", "Q8_0g"] and layer.compiled is None
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    want = torch.cat([x @ gguf_quant.dequantize(w, t, 512).T for t, w in file], 1)
    torch.testing.assert_close(layer(x), want)
    head = GGUFLinear([gguf_quant.to_planes(*file[1])], None).rows(torch.tensor([3, 0]))
    torch.testing.assert_close(head(x), want[:, [8 + 3, 8]], rtol=1e-5, atol=1e-4)    # another BLAS blocking


@pytest.mark.parametrize("steps", [1, gguf_quant.MAX_STEPS])
@pytest.mark.parametrize("qtype", sorted(gguf_quant.TYPES))
def test_compiled_kernel_matches_its_twin_and_is_batch_invariant(qtype, steps):
    ops = compiled()
    t = gguf_quant.TYPES[qtype]
    n, k = 48, 768
    w = gguf_quant.random_blocks(qtype, n, k, seed=1)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2))
    x[3, 5] = 40.0                                  # an outlier: its block's scale, not the row's
    y = ops.gguf_linear(x, [w], [t.id], None, steps)
    twin = gguf_quant.gguf_int8_matmul(x, w, qtype, steps)
    torch.testing.assert_close(y, twin, rtol=1e-5, atol=1e-5 * twin.abs().max().item())
    # Against the float weights: only the activations' rounding to int8 per 32 values differs.
    dense = x @ gguf_quant.dequantize(w, qtype, k).T
    assert ((y - dense).norm() / dense.norm()).item() < 0.02
    # Each row's output is the same to the bit alone, in a decode of up to 8 rows, in a tile of
    # more (9), or in the whole batch.
    for rows in (1, 2, 3, 4, 7, 8, 9):
        parts = torch.cat([ops.gguf_linear(x[i:i + rows], [w], [t.id], None, steps) for i in range(0, 63, rows)])
        assert torch.equal(parts, y[:len(parts)]), rows
    layout, repacked = gguf_quant.repack(qtype, w)        # the CPU kernel's layout of the same values
    got = ops.gguf_linear(x, [repacked], [gguf_quant.TYPES[layout].id], None, steps)
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5 * twin.abs().max().item())
    if t.act == 256:            # a K-quant's layout: the same integer sums per block, so the same float steps
        assert torch.equal(got, y)


def test_the_vnni_form_sums_the_same_integers_as_the_avx2_form():
    """A VNNI build sums the x4 layouts' and Q4_1's bytes in int32 and the K-quants' scaled pairs
    with VNNI's word dot products (SLUICE_VNNI_FORM, kernels/csrc/common.h). Built beside the served
    kernel in the form it does not take here (on AVX2 that form, VNNI's instructions done as
    AVX2's; on a VNNI host the AVX2 build), every type and layout gives the same outputs to the bit:
    decode rows, a tile and a part tile, one int8 scale per block or steps."""
    ops = compiled()
    served = cpu_build.BUILDS["sluice_gguf_linear"].isa
    other = cpu_build.build_beside(
        "sluice_gguf_other_form", "gguf_linear.cpp", (cpu_build.CSRC / "gguf_linear.cpp").read_text(),
        "sluice_other_form", "nothing falls back", defines=() if served != "AVX2" else ("SLUICE_VNNI_FORM",))
    assert other is not None, cpu_build.BUILDS["sluice_gguf_other_form"].error
    k = 768
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    for i, (name, t) in enumerate(sorted(gguf_quant.TYPES.items())):
        w = gguf_quant.random_blocks(name, 24, k, seed=i)
        for steps in (1, gguf_quant.MAX_STEPS):
            for rows in (1, 3, 8, 40):
                want = ops.gguf_linear(x[:rows], [w], [t.id], None, steps)
                assert torch.equal(other.gguf_linear(x[:rows], [w], [t.id], None, steps), want), (name, rows, steps)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_layer_of_mixed_parts_and_a_bias_is_its_parts_side_by_side(rows):
    """A fused q|k|v stored in several types is one call: x quantized once per activation layout
    (Q4_K and Q6_K share their int8 values but not their unit sums), each part's outputs in its
    columns, the bias added there: the same bits as a call per part and the bias added after."""
    ops = compiled()
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3))
    types = ["Q5_0", "Q8_0", "Q4_K", "Q6_K", "Q4_1", "Q4_Kx", "Q5_0x4", "Q8_0x4", "Q6_Kx"]
    ws = [gguf_quant.random_blocks(q, 16 + 8 * i, 512, seed=i) for i, q in enumerate(types)]
    ids = [gguf_quant.TYPES[q].id for q in types]
    bias = torch.randn(sum(len(w) for w in ws))
    y = ops.gguf_linear(x, ws, ids, bias)
    alone = torch.cat([ops.gguf_linear(x, [w], [i], None) for w, i in zip(ws, ids)], 1)
    assert torch.equal(y, alone + bias)
    assert torch.equal(ops.gguf_linear(x, ws, ids, None), alone)


def test_k_quant_activations_take_a_step_per_32_values():
    """An outlier sets its block of 256's scale, and only its own run of 32 takes that whole step:
    the other runs round on steps up to MAX_STEPS times finer, so the block's other values keep
    their bits (one scale per 256 rounds them to a few levels). Steps 1 is one scale per block."""
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(5))
    x[:, 7] = 60.0
    q, d, mult = gguf_quant.quantize_steps(x, 256, gguf_quant.MAX_STEPS)
    assert q.abs().max() <= 127 and mult.min() >= 1 and mult.max() <= gguf_quant.MAX_STEPS
    assert mult.view(4, 2, 8)[:, 0, 0].eq(gguf_quant.MAX_STEPS).all()      # the outlier's run
    assert mult.view(4, 2, 8)[:, 0, 1:].eq(1).all()             # its block's other runs: the finest
    others = torch.ones(512, dtype=torch.bool).index_fill_(0, torch.arange(32), False)
    back = (q.view(4, 16, 32).float() * (d.repeat_interleave(8, 1) * mult)[..., None]).view(4, 512)
    plain, scale = quant_matmul.quantize_rows(x, 256)
    plain_back = (plain.view(4, 2, 256).float() * scale[..., None]).view(4, 512)
    assert (back - x)[:, others].norm() < (plain_back - x)[:, others].norm() / 3
    q1, d1, m1 = gguf_quant.quantize_steps(x, 256, 1)
    assert torch.equal(q1, plain) and torch.equal(d1, scale) and m1.eq(1).all()


@pytest.mark.parametrize("steps", [1, 4, gguf_quant.MAX_STEPS])
def test_a_layer_computes_with_its_models_gguf_steps(steps):
    """ModelEntry.gguf_steps reaches the kernel: a K-quant layer's output is the twin's at that
    many steps, and a step per 32 values rounds a block with an outlier closer to the float
    result than one scale per 256 does."""
    compiled()
    w = gguf_quant.random_blocks("Q4_K", 32, 512, seed=4)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6))
    x[:, 40] = 50.0
    y = GGUFLinear([("Q4_K", w)], None, steps=steps)(x)
    twin = gguf_quant.gguf_int8_matmul(x, w, "Q4_K", steps)
    torch.testing.assert_close(y, twin, rtol=1e-5, atol=1e-5 * twin.abs().max().item())
    dense = x @ gguf_quant.dequantize(w, "Q4_K", 512).T
    one = GGUFLinear([("Q4_K", w)], None, steps=1)(x)
    if steps > 1:
        assert (y - dense).norm() < 0.7 * (one - dense).norm()
    with pytest.raises(ValueError, match="gguf_steps must be 1"):
        ModelEntry("m", quant="gguf", gguf_steps=0)
    with pytest.raises(ValueError, match="gguf_steps_on names projections of .* got gate_proj"):
        ModelEntry("m", quant="gguf", gguf_steps_on=("gate_proj",))
    assert config.MAX_GGUF_STEPS == gguf_quant.MAX_STEPS


def test_unknown_type_or_shape_is_refused():
    ops = compiled()
    w = gguf_quant.random_blocks("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="unknown type"):
        ops.gguf_linear(torch.randn(1, 64), [w], [9], None)
    with pytest.raises(RuntimeError, match="w uint8"):
        ops.gguf_linear(torch.randn(1, 96), [w], [0], None)
    with pytest.raises(RuntimeError, match="bias float32"):
        ops.gguf_linear(torch.randn(1, 64), [w], [0], torch.zeros(5))
    with pytest.raises(RuntimeError, match="steps 9 is not 1 to 8"):
        ops.gguf_linear(torch.randn(1, 64), [w], [0], None, 9)


def stored_equal_float(folder) -> int:
    """Every kept tensor of a type the kernels read dequantizes to the folder's float32 weights
    (which are gguf.quants.dequantize's) to the bit; returns how many were compared."""
    with safe_open(folder / convert.BLOCKS, framework="pt") as blocks, \
            safe_open(folder / "model.safetensors", framework="pt") as floats:
        types = blocks.metadata()
        names = [n for n in blocks.keys() if types[n] in gguf_quant.FILE_TYPES]
        for name in names:
            ref = floats.get_tensor(name)
            ours = gguf_quant.dequantize(blocks.get_tensor(name), types[name], ref.shape[1])
            assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), (name, types[name])
        return len(names)


def quantized_in(name: str) -> int:
    reader = GGUFReader(cache_dir() / "gguf" / f"{name}.gguf")
    return sum(t.tensor_type.name in gguf_quant.FILE_TYPES for t in reader.tensors)


def test_smollm2_blocks_are_kept_and_read_to_the_bit():
    folder = resolve("smollm2-135m", progress=False)
    assert stored_equal_float(folder) == quantized_in("smollm2-135m") > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_blocks_are_kept_and_read_to_the_bit(name):
    assert stored_equal_float(resolve(name, progress=False)) == quantized_in(name) > 0


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain what a hash map is in one sentence."]


def test_smollm2_as_shipped_picks_the_float_models_greedy_tokens_up_to_near_ties():
    """Greedy tokens of SmolLM2 on the GGUF's own blocks, scored teacher-forced by transformers on
    the same blocks dequantized to float32. The activations' rounding to int8 per 32 values is
    the only difference (about 0.5% of a matmul's output, kernel test above), so a token may
    differ from the float model's pick only where the two were nearly tied: within 0.5 nats
    (measured: 4 of 117 tokens differed, by 0.08-0.23 nats; int8 from float, served before,
    7 of 92 by up to 0.34)."""
    engine = LLMEngine(EngineConfig(models={"m": ModelEntry("smollm2-135m", quant="gguf")}, max_kv_blocks=256),
                       progress=False)
    prompter = engine.prompter()
    texts = [prompter.chat_text([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = engine.generate(texts, SamplingParams(max_tokens=24))
    reference = AutoModelForCausalLM.from_pretrained(resolve("smollm2-135m", progress=False),
                                                     dtype=torch.float32).eval()
    gaps = []
    for out in outs:
        with torch.no_grad():
            logprobs = reference(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0].log_softmax(-1)
        start = len(out.prompt_token_ids) - 1
        gaps += [(logprobs[start + i].max() - logprobs[start + i, t]).item() for i, t in enumerate(out.token_ids)]
    assert max(gaps) < 0.5, gaps
    assert sum(g == 0 for g in gaps) >= 0.9 * len(gaps), gaps


def test_a_type_no_kernel_reads_serves_in_float_with_a_warning(tmp_cache, tmp_path, caplog):
    path = tmp_path / "tiny-mixed.gguf"
    # q, k, o and the MLP in types the kernels read (q|k|v mixes three); v in Q5_1, which none reads.
    write_tiny_gguf("llama", path, {"q_proj": "Q8_0", "k_proj": "Q5_0", "v_proj": "Q5_1", "o_proj": "Q4_1",
                                    "mlp.": "Q8_0"})
    folder = resolve(str(path), progress=False)
    assert stored_equal_float(folder) == 12         # q, k, o, gate, up, down in each of 2 layers (not v)

    def load(quant: str):
        config = EngineConfig(models={"m": ModelEntry(str(path), quant=quant)})
        return worker._load(config.models["m"], False, Device.resolve(config))[1]
    with caplog.at_level(logging.WARNING):
        ours = load("gguf")
    assert any("self_attn.v_proj.weight is Q5_1" in r.getMessage() for r in caplog.records), caplog.text
    ref = load("none")
    layer, ref_layer = ours.layers[1], ref.layers[1]
    assert isinstance(layer.self_attn.o_proj, GGUFLinear) and isinstance(layer.mlp.down_proj, GGUFLinear)
    assert not isinstance(layer.self_attn.qkv_proj, GGUFLinear)     # v's Q5_1 keeps q|k|v in float
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer.self_attn.qkv_proj(x), ref_layer.self_attn.qkv_proj(x))
    for name in ("self_attn.o_proj", "mlp.gate_up_proj"):
        y, want = layer.get_submodule(name)(x), ref_layer.get_submodule(name)(x)
        assert ((y - want).norm() / want.norm()).item() < 0.02, name
    ids = torch.tensor([3, 17, 200])
    assert torch.equal(ours.embed_tokens(ids), ref.embed_tokens(ids))      # float32 embedding: kept as is


def test_one_call_decode_steps_on_gguf_blocks_equal_the_python_path(tmp_cache, tmp_path):
    """engine/cpu_step.py's compiled step calls the same gguf kernel on the same blocks (a q|k|v
    of three types among them, and the MLP repacked at load where its rows allow: down's 128
    columns are four blocks, Q5_0x4 in one layer and Q8_0x4 in the other; gate|up's 64 stay
    Q5_0), so its tokens and log-probabilities are the Python path's to the bit."""
    compiled()
    path = tmp_path / "tiny-gguf.gguf"
    write_tiny_gguf("llama", path, {"q_proj": "Q8_0", "k_proj": "Q5_0", "v_proj": "Q4_1", "o_proj": "Q4_1",
                                    "layers.1.mlp.down_proj": "Q8_0", "mlp.": "Q5_0"}, intermediate=128)
    config = EngineConfig(models={"m": ModelEntry(str(path), quant="gguf")})
    layers = worker._load(config.models["m"], False, Device.resolve(config))[1].layers
    assert [layer.mlp.down_proj.types for layer in layers] == [["Q5_0x4"], ["Q8_0x4"]]
    assert layers[0].mlp.gate_up_proj.types == ["Q5_0"]
    # gguf_steps reaches the projections gguf_steps_on names, and only those.
    stepped = EngineConfig(models={"m": ModelEntry(str(path), quant="gguf", gguf_steps=8,
                                                   gguf_steps_on=("gate_up_proj", "o_proj"))})
    layer = worker._load(stepped.models["m"], False, Device.resolve(stepped))[1].layers[1]
    assert [p.steps for p in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)] == [8, 8, 1]

    def run(cpu_step: bool):
        engine = LLMEngine(EngineConfig(models={"m": ModelEntry(str(path), quant="gguf")}, max_kv_blocks=64,
                                        cpu_step=cpu_step), progress=False)
        outs = engine.generate([[5, 9, 40, 7, 100], [3, 4, 5]], SamplingParams(max_tokens=12, ignore_eos=True))
        assert engine.stats()["m"]["gguf_steps"] == 1            # llama.cpp's q8_K rounding by default
        assert engine.stats()["m"]["gguf_steps_on"] == ["gate_up_proj"]
        return [(o.token_ids, o.logprobs) for o in outs], engine.stats()["m"]["cpu_steps"]
    (ours, steps), (ref, none) = run(True), run(False)
    assert steps > 0 and none == 0
    assert ours == ref


def test_loaded_blocks_hold_no_view_of_the_file(tmp_cache, tmp_path):
    """Blocks kept as stored (Q4_1 here, which no CPU layout repacks) are copied out of the
    blocks file's mapping: a view kept would hold the whole file resident for as long as the
    model lives."""
    path = tmp_path / "tiny-gguf.gguf"
    write_tiny_gguf("llama", path, {"proj": "Q4_1", "mlp.": "Q4_1"})
    config = EngineConfig(models={"m": ModelEntry(str(path), quant="gguf")})
    model = worker._load(config.models["m"], False, Device.resolve(config))[1]
    assert model.layers[0].self_attn.o_proj.types == ["Q4_1"]
    blocks = resolve(str(path), progress=False) / convert.BLOCKS
    assert blocks.is_file() and str(blocks) not in Path("/proc/self/maps").read_text()


def test_a_truncated_gguf_is_an_error_naming_the_file(tmp_cache, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf("llama", path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError, match=r"tiny\.gguf"):
        resolve(str(path), progress=False)


def test_gguf_precision_on_a_float_checkpoint_is_refused(tmp_path):
    model, _ = write_tiny_gguf("llama", tmp_path / "t.gguf")
    model.save_pretrained(tmp_path / "hf")
    shutil.copy(resolve(str(tmp_path / "t.gguf"), progress=False) / "tokenizer.json", tmp_path / "hf")
    with pytest.raises(ValueError, match="int8 or int4"):
        LLMEngine(EngineConfig(models={"m": ModelEntry(str(tmp_path / "hf"), quant="gguf")}), progress=False)


@triton_only
@pytest.mark.parametrize("qtype", gguf_quant.FILE_TYPES + tuple(gguf_quant.PLANAR))
@pytest.mark.parametrize("splits", [1, 3, None])       # slices of K summed by a second launch; None: planned
@pytest.mark.parametrize("M", [1, 3])
def test_triton_gguf_matmul_matches_its_reference(qtype, splits, M):
    """The GPU's kernel, interpreted on the CPU in float32, against the dense reference over the
    same blocks dequantized; N not a multiple of the output tile, M not of the row tile, K in
    slices that do not divide its blocks evenly."""
    from kernels import gguf_quant_triton
    w = gguf_quant.random_blocks(qtype, 40, 1280, seed=3)
    x = torch.randn(M, 1280, generator=torch.Generator().manual_seed(4))
    got = gguf_quant_triton.gguf_matmul(x, w, qtype, block_n=16, splits=splits)
    want = gguf_quant.gguf_matmul(x, w, qtype)
    # float32 sums in another order: they differ in the fifth or sixth digit.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
