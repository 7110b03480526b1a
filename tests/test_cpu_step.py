"""A CPU decode step as one compiled call (engine/cpu_step.py, kernels/decoder_cpu.py) against
its twin, the model's forward calling the same operators from Python: the same tokens and the
same log-probabilities to the bit, since the operators and their order are the same."""
import pytest
import torch

import kernels
from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.quantize import dot_matmul
from engine.sampling_params import SamplingParams
from kernels import decoder_cpu
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not (kernels.layer_cpu.load() and decoder_cpu.load()),
                                reason="the compiled CPU kernels cannot be built on this host")


def _engine(folder, quant, kv, cpu_step, monkeypatch, tmp_path, **entry):
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "cache"))
    models = {"m": ModelEntry(str(folder), quant=quant, group_size=32, **entry)}
    return LLMEngine(EngineConfig(models=models, max_kv_blocks=64, block_size=4, memory_budget_gb=1.0,
                                  kv_cache_dtype=kv, cpu_step=cpu_step), progress=False)


# Each projection kind (float32, int8, int4), with and without biases (Qwen2's q|k|v), and
# both caches.
@pytest.mark.parametrize("arch, quant, kv", [("llama", "none", "int8"), ("qwen2", "none", "auto"),
                                             ("qwen2", "int8", "int8"), ("llama", "int8", "auto"),
                                             ("qwen2", "int4", "auto")])
def test_compiled_decode_step_equals_the_python_one_to_the_bit(tmp_path, monkeypatch, arch, quant, kv):
    if quant != "none" and dot_matmul(quant, 32) in (None, kernels.quant_matmul.int8_int8_matmul):
        pytest.skip("the compiled integer kernels do not serve this host's decode matmuls")
    folder = make_tiny_model(tmp_path / arch, arch, seed=5)
    torch.manual_seed(0)
    # Three sequences of different lengths: batched decode steps with ragged block tables.
    prompts = [torch.randint(0, 127, (n,)).tolist() for n in (5, 13, 30)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for on in (False, True):
        engine = _engine(folder, quant, kv, on, monkeypatch, tmp_path)
        step = engine.workers["m"].runner.cpu_step
        assert (step is not None) == on
        outs[on] = engine.generate(prompts, params)
        if on:
            # Every step after the prompts ran as one call (the first token comes from the prefill).
            assert step.steps >= params.max_tokens - 1
            assert engine.stats()["m"]["cpu_steps"] == step.steps
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_models_and_rows_it_does_not_take(tmp_path, monkeypatch):
    # Qwen3's q/k norms are not in the compiled decoder: the model's forward serves.
    engine = _engine(make_tiny_model(tmp_path / "q3", "qwen3"), "none", "auto", True, monkeypatch, tmp_path)
    assert engine.workers["m"].runner.cpu_step is None
    if dot_matmul("int8", 32) in (None, kernels.quant_matmul.int8_int8_matmul):
        return
    # int8 on the integer kernels from 2 rows only: a batch of one is left to the packed op.
    folder = make_tiny_model(tmp_path / "l", "llama")
    engine = _engine(folder, "int8", "auto", True, monkeypatch, tmp_path, dot_rows=2)
    step = engine.workers["m"].runner.cpu_step
    assert 1 not in step.rows and 2 in step.rows
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert step.steps == 0
