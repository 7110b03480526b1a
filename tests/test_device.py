"""The engine's device code on the CPU: config resolution, the memory budget, the compute
dtype, a Triton kernel that cannot launch, QuantLinear on the kernels' path, and the decode
graphs' padding and static buffers (replayed eagerly here; tests/test_gpu.py captures them
on a GPU)."""
import logging
import types

import pytest
import torch

import kernels
from engine import model_runner
from engine.config import EngineConfig, ModelEntry, SpecConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import Device
from engine.quantize import QuantLinear
from engine.sampling_params import SamplingParams
from tests.conftest import quantized
from tests.test_engine import folder, make_engine, prompts  # noqa: F401 (fixture)

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
triton_only = pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")


def config(**kw) -> EngineConfig:
    return EngineConfig(models={"m": ModelEntry("x")}, **kw)


def test_auto_resolves_to_the_cpu_in_float32_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Device.resolve(config()) == Device(torch.device("cpu"), torch.float32, cuda_graphs=False, cpu_step=True)
    assert Device.resolve(config(dtype="bfloat16", kv_cache_dtype="bfloat16")).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="no CUDA device"):
        Device.resolve(config(device="cuda"))
    with pytest.raises(ValueError, match="differs from the compute dtype"):
        Device.resolve(config(kv_cache_dtype="bfloat16"))


def test_auto_resolves_to_cuda_in_bfloat16_with_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    assert Device.resolve(config()) == Device(torch.device("cuda", 0), torch.bfloat16, cuda_graphs=True)
    assert Device.resolve(config(device="cuda:1", cuda_graphs=False)) == \
        Device(torch.device("cuda", 1), torch.bfloat16, cuda_graphs=False)
    assert made_current == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert Device.resolve(config(dtype="float32", kv_cache_dtype="int8")).dtype == torch.float32
    with pytest.raises(ValueError, match="differs from the compute dtype"):
        Device.resolve(config(kv_cache_dtype="float32"))     # float32 KV under bf16 compute


def test_bad_device_settings_are_rejected():
    for bad, match in ((dict(device="gpu"), "device must be"), (dict(dtype="float16"), "dtype must be"),
                       (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                       (dict(kv_cache_dtype="fp8"), "kv_cache_dtype")):
        with pytest.raises(ValueError, match=match):
            config(**bad)


def test_memory_budget_is_a_share_of_free_device_memory_on_cuda(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: seen.append(d) or (10 * 2**30, 80 * 2**30))
    cuda = Device(torch.device("cuda", 0), torch.bfloat16)
    assert cuda.memory_budget(config(gpu_memory_utilization=0.5, memory_budget_gb=1.0)) == 5 * 2**30
    assert seen == [torch.device("cuda", 0)]
    assert Device().memory_budget(config(memory_budget_gb=1.5)) == int(1.5 * 2**30)


def test_weights_and_kv_follow_the_compute_dtype(folder):  # noqa: F811
    budget = dict(memory_budget_gb=0.02, max_kv_blocks=None)
    f32, bf16 = make_engine(folder, **budget), make_engine(folder, dtype="bfloat16", **budget)
    w32, w16 = f32.worker("tiny"), bf16.worker("tiny")
    assert {p.dtype for p in w16.model.parameters()} == {torch.bfloat16}
    assert w16.runner.kv_dtype == torch.bfloat16 and w32.runner.kv_dtype == torch.float32
    # Half the bytes per weight and per KV entry: the same budget holds more than twice the
    # blocks (the weights take less of it too).
    assert len(w16.block_manager.blocks) > 2 * len(w32.block_manager.blocks)
    out = bf16.generate(prompts(2), GREEDY)
    assert all(len(c.token_ids) == 24 and all(lp <= 0 for lp in c.logprobs) for c in out)


class _CannotLaunch:
    """A Triton kernel that fails at launch as an oversized kernel does on a real GPU."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime.errors import OutOfResources
            self.launches += 1
            raise OutOfResources(1311232, 232448, "shared memory")
        return launch


@triton_only
def test_a_kernel_that_cannot_launch_falls_back_to_its_reference_once(monkeypatch, caplog):
    from kernels import activation_triton
    monkeypatch.setattr(kernels, "FALLBACKS", set())
    monkeypatch.setattr(kernels, "_use_triton", lambda t: True)
    monkeypatch.setattr(activation_triton, "_silu_and_mul_kernel", broken := _CannotLaunch())
    x = torch.randn(3, 2, 64)
    want = kernels.activation.silu_and_mul(x)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        first, second = kernels.silu_and_mul(x), kernels.silu_and_mul(x)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert broken.launches == 1 and kernels.FALLBACKS == {"silu_and_mul"}
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "silu_and_mul cannot launch" in caplog.records[0].message
    # The other kernels still run their Triton twins.
    out, _ = kernels.add_rms_norm(x.view(6, 64), None, torch.ones(64), 1e-6)
    assert kernels.FALLBACKS == {"silu_and_mul"}
    torch.testing.assert_close(out, kernels.norm_rope.add_rms_norm(x.view(6, 64), None, torch.ones(64), 1e-6)[0])


@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=triton_only)])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quant_linear_on_the_kernels_path_matches_the_packed_one(mode, triton, monkeypatch):
    """The layout a GPU gets (the stored format, through the dispatcher) against the dequantized
    float twin and the CPU's packed ops; with `triton` the dispatcher runs the Triton kernel
    (interpreted), as on CUDA."""
    from kernels import quant_matmul_triton
    torch.manual_seed(0)
    w, x, b = torch.randn(48, 64), torch.randn(5, 64), torch.randn(48)
    tensors, deq = quantized(w, mode, 32)
    launches = []
    kernel = getattr(quant_matmul_triton, f"_{mode}_kernel")
    monkeypatch.setattr(quant_matmul_triton, f"_{mode}_kernel",
                        _Spy(kernel, launches))
    monkeypatch.setattr(kernels, "_use_triton", lambda t: triton)
    layer = QuantLinear(mode, tensors, b, 32, packed=False)
    assert torch.equal(layer.w, tensors["w"]) and not hasattr(layer, "scales_and_zeros")     # the stored format, as is
    got = layer(x)
    assert len(launches) == triton
    torch.testing.assert_close(got, x @ deq.T + b, rtol=1e-4, atol=1e-4)
    packed = QuantLinear(mode, tensors, b, 32)(x)                  # bf16 activations: looser
    torch.testing.assert_close(got, packed, rtol=0.05, atol=0.1)


class _Spy:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


class _Replays:
    """Stands in for torch.cuda.graph off CUDA: replay() runs the captured step eagerly on
    the same static tensors, which is what a graph replays."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.captured, self.replays = monkeypatch, [], 0

    def capture(self, step, pool):
        def replay():
            self.replays += 1
            step()
        self.captured.append(step)
        return types.SimpleNamespace(replay=replay), pool

    def enable(self) -> None:
        """Engines built from now on capture decode graphs, on the CPU in float32."""
        self.monkeypatch.setattr(model_runner, "_capture", self.capture)
        self.monkeypatch.setattr(Device, "resolve", classmethod(lambda cls, config: Device(cuda_graphs=True)))


@pytest.fixture
def emulated_graphs(monkeypatch):
    return _Replays(monkeypatch)


def test_decode_graph_padding_and_static_buffers_equal_eager(folder, emulated_graphs):  # noqa: F811
    # Five live sequences padded to 8 rows (the padding writes while every block is in use),
    # then fewer as they finish. Greedy rows take the head graph's picks; a sampled row and
    # one with a stop token banned (after its thinking span) read its logits.
    ps = prompts(5, seed=5)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 24, 30)] + \
        [SamplingParams(max_tokens=36, ignore_eos=True, temperature=0.8, seed=3),
         SamplingParams(max_tokens=40, max_thinking_tokens=6, stop_token_ids=[5])]
    eager = make_engine(folder, max_num_seqs=8).generate(ps, params)
    emulated_graphs.enable()
    engine = make_engine(folder, max_num_seqs=8)
    runner = engine.worker("tiny").runner
    # Per batch size, the layers' graph and the head's three (greedy, sampled, filtered).
    assert runner.graphs.buckets == [1, 2, 4, 8] and len(emulated_graphs.captured) == 16
    assert sorted(runner.graphs.heads) == [(b, h) for b in (1, 2, 4, 8) for h in ("filtered", "greedy", "sampled")]
    # One block beyond the block manager's: the padded rows' scratch block.
    assert runner.kv_caches[0][0].shape[0] == len(engine.worker("tiny").block_manager.blocks) + 1 == 257
    got = engine.generate(ps, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in eager]
    for a, b in zip(got, eager):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    assert emulated_graphs.replays > 0
    stats = engine.stats()["tiny"]
    assert stats["kv_blocks_free"] == 256 and stats["cuda_graph_batch_sizes"] == [1, 2, 4, 8]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampled_decode_through_the_head_graphs_equals_eager(folder, emulated_graphs, async_scheduling):  # noqa: F811
    """Seeded requests (temperature alone, top-k / top-p) with greedy and thinking ones (bans
    pick again after the graph): the sampled heads' `select` on the static rows and noise gives
    eager's tokens, both heads replayed; as many live sequences as buckets, then fewer."""
    ps = prompts(6, seed=31)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=26, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.1, top_p=0.9, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.7, top_k=6, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, seed=4, max_thinking_tokens=5, stop_token_ids=[5]),
              SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)]
    eager = make_engine(folder, max_num_seqs=8, async_scheduling=async_scheduling).generate(ps, params)
    emulated_graphs.enable()
    engine = make_engine(folder, max_num_seqs=8, async_scheduling=async_scheduling)
    graphs = engine.worker("tiny").runner.graphs
    replays = {"greedy": 0, "sampled": 0, "filtered": 0}
    for (_, mode), graph in graphs.heads.items():
        graph.replay = lambda mode=mode, replay=graph.replay: (replays.__setitem__(mode, replays[mode] + 1), replay())
    got = engine.generate(ps, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in eager]
    for a, b in zip(got, eager):
        assert a.error is None
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    # The filtered head while a top-k / top-p request decodes, then the plain sampled one.
    assert replays["filtered"] > 0 and replays["sampled"] > 0
    # Temperature alone: the same draws, filtered head or not.
    alone = [SamplingParams(max_tokens=16, temperature=0.8, seed=1, ignore_eos=True)]
    assert engine.generate(ps[:1], alone)[0].token_ids == eager[0].token_ids[:16]


def test_a_drafter_replays_its_layers_alone_and_reads_its_own_sub_vocabulary(folder, emulated_graphs):  # noqa: F811
    """The model drafts for itself through a 64-token sub-vocabulary head: its decode steps
    replay the layers' graph, not the full head's, and greedy output is plain greedy's."""
    ps = prompts(3, seed=8)
    plain = make_engine(folder).generate(ps, GREEDY)
    emulated_graphs.enable()
    spec = SpecConfig(target="tiny", draft="draft", prompt_lookup=False, max_k=3, draft_cost=0.1, verify_cost=0.05,
                      draft_prefill_cost=0.05, govern=False, draft_vocab=64)  # pinned: measured, load-dependent
    engine = make_engine(folder, models={"tiny": ModelEntry(str(folder)), "draft": ModelEntry(str(folder))},
                         speculative=spec, max_num_seqs=4)
    draft = engine.worker("draft").runner
    assert engine.speculator.draft_vocab is not None and draft.graphs is not None
    replays = {"layers": 0, "head": 0}
    for part, graphs in (("layers", draft.graphs.graphs), ("head", draft.graphs.heads)):
        for graph in graphs.values():
            graph.replay = lambda part=part, replay=graph.replay: (replays.__setitem__(part, replays[part] + 1),
                                                                   replay())
    got = engine.generate(ps, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert engine.stats()["tiny"]["speculation"]["accepted"] > 0
    assert replays["layers"] > 0 and replays["head"] == 0


def test_a_sampled_drafter_with_the_full_head_selects_after_its_greedy_graph(folder, emulated_graphs):  # noqa: F811
    """Seeded sampled speculation, the drafter on the full vocabulary: its steps want the
    distributions for the rejection rule, which a graph keeps to itself, so they replay the
    greedy head and run `select` after it; the tokens equal the same engine's without graphs."""
    ps = prompts(3, seed=33)
    params = [SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    spec = SpecConfig(target="tiny", draft="draft", prompt_lookup=False, max_k=3, draft_cost=0.1, verify_cost=0.05,
                      draft_prefill_cost=0.05, govern=False, draft_vocab=0)  # pinned: measured, load-dependent
    models = {"tiny": ModelEntry(str(folder)), "draft": ModelEntry(str(folder))}
    eager = make_engine(folder, models=models, speculative=spec, max_num_seqs=4).generate(ps, params)
    emulated_graphs.enable()
    engine = make_engine(folder, models=models, speculative=spec, max_num_seqs=4)
    heads = {"greedy": 0, "sampled": 0, "filtered": 0}
    for (_, mode), graph in engine.worker("draft").runner.graphs.heads.items():
        graph.replay = lambda mode=mode, replay=graph.replay: (heads.__setitem__(mode, heads[mode] + 1), replay())
    got = engine.generate(ps, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in eager] and all(c.error is None for c in got)
    assert heads["greedy"] > 0 and heads["sampled"] == heads["filtered"] == 0
    assert engine.stats()["tiny"]["speculation"]["proposed"] > 0


def test_graphs_stay_off_when_decode_attention_runs_its_reference(folder, emulated_graphs, monkeypatch,  # noqa: F811
                                                                   caplog):
    ps = prompts(3, seed=6)
    eager = make_engine(folder).generate(ps, GREEDY)
    emulated_graphs.enable()
    monkeypatch.setattr(kernels, "FALLBACKS", {"paged_decode_attention"})
    with caplog.at_level(logging.WARNING, logger="sluice.engine"):
        engine = make_engine(folder, max_num_seqs=4)
    assert engine.worker("tiny").runner.graphs is None and emulated_graphs.captured == []
    assert "CUDA graphs off" in caplog.text
    stats = engine.stats()["tiny"]
    assert (stats["device"], stats["cuda_graph_batch_sizes"], stats["kernel_fallbacks"]) == \
        ("cpu", [], ["paged_decode_attention"])
    assert [c.token_ids for c in engine.generate(ps, GREEDY)] == [c.token_ids for c in eager]
