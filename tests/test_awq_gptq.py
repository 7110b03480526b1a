"""AWQ and GPTQ checkpoints on the int4 kernels: a tiny random model is quantized here and
written in each library's own packing (the loops below follow AutoAWQ's WQLinear_GEMM.from_linear
and AutoGPTQ's QuantLinear.pack), then loaded through the engine: every layer holds exactly the
integers, scales and zeros that were packed, the model computes what a float model on the same
dequantized weights computes, and checkpoints the kernels cannot take are refused by name."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import awq_gptq
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.model import Linear, load_model
from engine.model_runner import ModelRunner
from engine.quantize import QuantLinear, apply_quantization, dot_matmul
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step import ScheduledSeq
from tests.conftest import make_tiny_model

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# (checkpoint format, architecture, group, tied embeddings): every group the kernels take, qkv
# biases (Qwen2), q/k norms (Qwen3) and a tied float head (the Llama).
CASES = {"awq": ("qwen2", 128, False), "gptq": ("llama", 64, True), "gptq_v2": ("qwen3", 32, False)}


def quantize(w: torch.Tensor, group: int, lowest_zero: int):
    """Asymmetric 4-bit per group, as both libraries quantize: integers q [N, K], zeros [N, K / group]
    (at least `lowest_zero`), fp16 scales [N, K / group], and the weight they stand for."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-5).half()
    zeros = (-lo / scales.float()).round().clamp(lowest_zero, 15)
    q = (g / scales.float()[..., None] + zeros[..., None]).round().clamp(0, 15)
    deq = (q - zeros[..., None]) * scales.float()[..., None]
    return q.view(n, k).int(), zeros.int(), scales, deq.view(n, k)


def pack_awq(q, zeros, scales, group):
    """AutoAWQ's GEMM layout: outputs packed eight to an int32 along N in AWQ_ORDER."""
    intweight, zeros = q.t().contiguous(), zeros.t().contiguous()         # [K, N], [K / group, N]
    qweight = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int32)
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // 8, dtype=torch.int32)
    for col in range(qweight.shape[1]):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
            qzeros[:, col] |= zeros[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous()}


def pack_gptq(q, zeros, scales, group, v1: bool):
    """AutoGPTQ's layout: inputs packed eight to an int32 along K, zeros eight along N, stored as
    zero - 1 in the v1 format."""
    intweight = q.t().contiguous().numpy().astype(np.uint32)                 # [K, N]
    zeros = (zeros.t().contiguous().numpy() - int(v1)).astype(np.uint32)    # [K / group, N]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + j] << (4 * j)
    k = intweight.shape[0]
    return {"qweight": torch.from_numpy(qweight.astype(np.int32)), "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
            "scales": scales.t().contiguous(), "g_idx": torch.arange(k, dtype=torch.int32) // group}


def quantization_config(fmt: str, group: int, **overrides) -> dict:
    """config.json's quantization_config as transformers writes it for AutoAWQ and AutoGPTQ."""
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
              "true_sequential": True, "checkpoint_format": fmt}
    return qc | overrides


def write_checkpoint(tmp: Path, fmt: str, **overrides):
    """A tiny random model of CASES[fmt] quantized into `fmt`'s packing (`quant`, its config.json
    with quantization_config) and a float folder of the same weights dequantized (`float`); and
    what was packed, per Hugging Face projection: (q, zeros, scales)."""
    arch, group, tie = CASES[fmt]
    float_folder = make_tiny_model(tmp / "float", arch, seed=5, tie=tie, hidden_size=128, intermediate_size=256)
    tensors = load_file(float_folder / "model.safetensors")
    packed, dequantized, values = {}, {}, {}
    for name, w in tensors.items():
        layer = name.removesuffix(".weight")
        if not layer.endswith(PROJ):
            packed[name] = dequantized[name] = w
            continue
        q, zeros, scales, deq = quantize(w, group, lowest_zero=int(fmt == "gptq"))
        values[layer] = (q, zeros, scales)
        parts = pack_awq(q, zeros, scales, group) if fmt == "awq" else pack_gptq(q, zeros, scales, group, fmt == "gptq")
        packed |= {f"{layer}.{part}": t for part, t in parts.items()}
        dequantized[name] = deq
    save_file(dequantized, float_folder / "model.safetensors")
    folder = tmp / fmt
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((float_folder / f).read_bytes())
    config = json.loads((float_folder / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group, **overrides)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(packed, folder / "model.safetensors")
    return folder, float_folder, values


def prefill_logits(model, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt, run through the model runner by hand."""
    bm, runner = BlockManager(64, 4), ModelRunner(model, cfg, 64, 4)
    seq = Sequence(list(ids), SamplingParams())
    bm.allocate(seq)
    assert bm.resize(seq, len(seq))
    with torch.inference_mode():
        tokens, positions, batch, _ = runner.prepare([ScheduledSeq(seq, 0, len(ids), True)])
        return model.logits(model(tokens, positions, batch))


def engine_int4(value: torch.Tensor) -> torch.Tensor:
    """Integers [N, K] in QuantLinear's int4 packing: two per byte, the even k low."""
    q = value.to(torch.uint8)
    return q[:, 0::2] | q[:, 1::2] << 4


@pytest.mark.parametrize("fmt", list(CASES))
def test_layers_hold_the_packed_integers_and_compute_the_dequantized_model(tmp_path, fmt):
    """Each fused layer holds exactly the integers, scales and zeros written (GPTQ v1's zero - 1
    undone), in the engine's output order; computing every matmul on the kernels' float reference
    over those weights (dequant_rows 1), the model's logits are the float model's on the same
    dequantized weights, to float32 rounding."""
    if dot_matmul("int4", CASES[fmt][1]) is None:
        pytest.skip("no compiled int4 kernels here: torch's packed layout does not keep the stored format")
    folder, float_folder, values = write_checkpoint(tmp_path, fmt)
    cfg = ModelConfig.from_folder(folder)
    scheme = awq_gptq.scheme(folder, fmt.removesuffix("_v2"))
    assert scheme.group == CASES[fmt][1] and scheme.zero_offset == int(fmt == "gptq")
    model = awq_gptq.load(folder, cfg, scheme, torch.device("cpu"), torch.float32, dequant_rows=1, dot_rows=1)
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for i in range(cfg.num_layers):
        for parent, child in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                              ("mlp", "down_proj")):
            layer = model.get_submodule(f"layers.{i}.{parent}.{child}")
            assert isinstance(layer, QuantLinear) and (layer.mode, layer.group, layer.packed) == ("int4", scheme.group,
                                                                                                 False)
            q, zeros, scales = zip(*(values[f"model.layers.{i}.{parent}.{hf}"] for hf in fused.get(child, (child,))))
            assert torch.equal(layer.w, torch.cat([engine_int4(v) for v in q]))
            assert torch.equal(layer.zeros, torch.cat(zeros).float())
            assert torch.equal(layer.scales, torch.cat(scales).float())
    assert isinstance(model.lm_head, Linear)          # kept in float, as the checkpoint keeps it
    ids = torch.randint(0, 127, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    want = prefill_logits(load_model(float_folder), cfg, ids)
    torch.testing.assert_close(prefill_logits(model, cfg, ids), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", list(CASES))
def test_engine_serves_the_checkpoint_as_its_dequantized_float_model(tmp_path, fmt, monkeypatch):
    """Through the engine with its default int4 kernels (integer dot products on int8 activations
    where they build, else torch's packed op on bf16 ones), against the float model on the same
    dequantized weights: the logits stay within the activations' rounding (measured 1.3-5.4%
    relative), nearer than the float detour (requantizing the dequantized weights to int4: 8-11%),
    and every greedy choice that is not a near-tie (top two within 0.5) is the same. Nothing is
    cached: the checkpoint's integers are read as is."""
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "cache"))
    folder, float_folder, _ = write_checkpoint(tmp_path, fmt)
    prompt = torch.randint(0, 127, (48,), generator=torch.Generator().manual_seed(2)).tolist()

    def engine(source: Path, quant: str) -> LLMEngine:
        config = EngineConfig(models={"m": ModelEntry(str(source), quant=quant)}, max_kv_blocks=64, block_size=4,
                              memory_budget_gb=1.0)
        return LLMEngine(config, progress=False)

    float_engine, quant_engine = engine(float_folder, "none"), engine(folder, fmt.removesuffix("_v2"))
    params = SamplingParams(max_tokens=1)
    assert quant_engine.generate([prompt], params)[0].token_ids == float_engine.generate([prompt], params)[0].token_ids
    assert not (tmp_path / "cache" / "derived").exists()
    stats, float_stats = quant_engine.stats()["m"], float_engine.stats()["m"]
    assert stats["quant"] == fmt.removesuffix("_v2") and stats["weight_bytes"] < float_stats["weight_bytes"]
    cfg, model = ModelConfig.from_folder(folder), quant_engine.workers["m"].model
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    want = prefill_logits(float_engine.workers["m"].model, cfg, prompt)
    got = prefill_logits(model, cfg, prompt)
    top2 = want.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 0.5
    assert clear.sum() > len(prompt) // 2 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    detour = apply_quantization(load_model(float_folder), "int4", CASES[fmt][1],
                                dot_rows=model.layers[0].mlp.down_proj.dot_rows)
    error = {name: ((logits - want).norm() / want.norm()).item()
             for name, logits in (("own", got), ("detour", prefill_logits(detour, cfg, prompt)))}
    assert error["own"] < min(0.08, error["detour"]), error


def test_the_awq_nibble_order_is_undone():
    """One int32 column: AutoAWQ puts output AWQ_ORDER[i] in nibble i, so 0x76543210 holds outputs
    0, 4, 1, 5, 2, 6, 3, 7 as 0..7."""
    scheme = awq_gptq.Scheme("awq", 32)
    qweight = torch.full((32, 1), 0x76543210, dtype=torch.int32)
    tensors = awq_gptq.unpack(scheme, qweight, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 8).half())
    q = torch.stack([tensors["w"] & 15, tensors["w"] >> 4], -1).flatten(1)
    assert q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("fmt, overrides, quant, message", [
    ("awq", {"bits": 3}, "awq", "bits = 3"),
    ("gptq", {"bits": 8}, "gptq", "bits = 8"),
    ("awq", {"group_size": 256}, "awq", "group_size = 256"),
    ("awq", {"version": "gemv"}, "awq", "version = 'gemv'"),
    ("gptq", {"checkpoint_format": "marlin"}, "gptq", "checkpoint_format = 'marlin'"),
    ("awq", {}, "none", "serve it with quant 'awq'"),
    ("gptq", {}, "int4", "serve it with quant 'gptq'"),
])
def test_checkpoints_the_int4_kernels_cannot_take_are_refused_by_name(tmp_path, fmt, overrides, quant, message):
    folder, float_folder, _ = write_checkpoint(tmp_path, fmt, **overrides)
    with pytest.raises(ValueError, match=message) as err:
        LLMEngine(EngineConfig(models={"m": ModelEntry(str(folder), quant=quant)}), progress=False)
    assert str(folder) in str(err.value)


def test_act_order_gptq_and_a_float_folder_are_refused(tmp_path):
    folder, float_folder, _ = write_checkpoint(tmp_path, "gptq", desc_act=True)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    tensors["model.layers.0.mlp.down_proj.g_idx"] = g_idx[torch.randperm(len(g_idx))].contiguous()
    save_file(tensors, path)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj was quantized in activation order.*desc_act"):
        LLMEngine(EngineConfig(models={"m": ModelEntry(str(folder), quant="gptq")}), progress=False)
    with pytest.raises(ValueError, match="no quantization_config"):
        LLMEngine(EngineConfig(models={"m": ModelEntry(str(float_folder), quant="awq")}), progress=False)


@pytest.mark.parametrize("fmt, legacy, renamed", [
    ("gptq", "quantize_config.json", {}),
    ("awq", "quant_config.json", {"bits": "w_bit", "group_size": "q_group_size"}),
])
def test_the_libraries_own_config_files_are_read(tmp_path, fmt, legacy, renamed):
    """Checkpoints saved by AutoGPTQ and AutoAWQ before transformers read them state their
    quantization in the libraries' own file (AutoAWQ's with its own key names), not config.json."""
    folder, _, _ = write_checkpoint(tmp_path, fmt)
    config = json.loads((folder / "config.json").read_text())
    qc = {renamed.get(k, k): v for k, v in config.pop("quantization_config").items()
          if k not in ("quant_method", "checkpoint_format")}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / legacy).write_text(json.dumps(qc))
    assert awq_gptq.scheme(folder, fmt) == awq_gptq.Scheme(fmt, CASES[fmt][1], zero_offset=int(fmt == "gptq"))
    with pytest.raises(ValueError, match=rf"\({legacy}\); serve it with quant '{fmt}'"):
        awq_gptq.scheme(folder, "none")
