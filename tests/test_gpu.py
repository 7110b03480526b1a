"""The engine on a CUDA GPU, against the CPU float32 engine: greedy output of the tiny test
models, proxy scores, CUDA-graph replay against eager, both models in one engine, speculative decoding
against plain decoding, quantized layers against their float twins. Skipped without CUDA
(the CPU side of the same code is tests/test_device.py)."""
import pytest
import torch

from engine.config import EngineConfig, ModelEntry, SpecConfig
from engine.llm_engine import LLMEngine
from engine.quantize import QuantLinear, fp8_native, quantize_fp8
from engine.sampling_params import SamplingParams
from tests.conftest import make_tiny_model, quantized
from tests.test_engine import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch sees none); tests/test_device.py covers the CPU side")

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def engine(models: dict[str, str], device: str = "cuda", speculative: SpecConfig | None = None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(models={n: ModelEntry(str(f)) for n, f in models.items()}, device=device,
                                  block_size=16, max_kv_blocks=256, max_num_batched_tokens=256, max_num_seqs=16,
                                  speculative=speculative, **kw), progress=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    return make_tiny_model(root / "large", "qwen2", seed=1), make_tiny_model(root / "small", "llama", seed=2,
                                                                              num_hidden_layers=1)


def assert_same_or_near_tie(cpu: LLMEngine, prompt: list[int], want, got, tol: float) -> None:
    """Equal tokens, or up to the first difference, where the CPU model found the GPU's token
    within `tol` nats of its own (a near-tie that bf16 flips)."""
    i = next((i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b), None)
    if i is None:
        assert want.token_ids == got.token_ids
        return
    theirs = cpu.score(prompt + got.token_ids[:i + 1])[-1]
    assert want.logprobs[i] - theirs < tol, f"token {i}: cpu {want.token_ids[i]} vs gpu {got.token_ids[i]}"


# Triton's float32 tl.dot runs in TF32: float32 on the GPU is close to the CPU's, not equal. bf16
# against float32 on these models, measured on the CPU: log-probabilities 0.034 apart on average,
# 0.13 at most (teacher-forced, 60 tokens).
@pytest.mark.parametrize("dtype,tol,lp_tol", [("float32", 0.02, 0.02), ("bfloat16", 0.3, 0.3)])
def test_greedy_output_on_cuda_equals_the_cpu_float32_engine(tiny_folder, dtype, tol, lp_tol):
    cpu = engine({"m": tiny_folder}, device="cpu")
    gpu = engine({"m": tiny_folder}, dtype=dtype)
    assert gpu.worker("m").runner.kv_caches[0][0].is_cuda
    ps = prompts(8, seed=11)
    for p, want, got in zip(ps, cpu.generate(ps, GREEDY), gpu.generate(ps, GREEDY)):
        assert_same_or_near_tie(cpu, p, want, got, tol)
        if want.token_ids == got.token_ids:
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=lp_tol)


def test_proxy_scores_on_cuda_equal_the_cpu_float32_engine(tiny_folder):
    """The labelling proxy (evals/lab/proxy.py) on a GPU: references scored after a prompt the
    prefix cache holds, against the CPU scoring each sequence whole."""
    cpu = engine({"m": tiny_folder}, device="cpu")
    gpu = engine({"m": tiny_folder}, dtype="float32")
    prompt, refs = prompts(1, seed=15)[0] * 3, [r[:6] for r in prompts(3, seed=16)]
    gpu.score(prompt + refs[0], first=len(prompt))                # fills the cache for the next two
    for r in refs:
        want = cpu.score(prompt + r)[len(prompt) - 1:]
        got = gpu.score(prompt + r, first=len(prompt))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=0.02)
    assert gpu.stats()["m"]["prefix_cache_hits"] > 0


def test_cuda_graph_replay_equals_eager(tiny_folder):
    eager = engine({"m": tiny_folder}, dtype="float32", cuda_graphs=False)
    graphs = engine({"m": tiny_folder}, dtype="float32")
    runner = graphs.worker("m").runner
    assert eager.worker("m").runner.graphs is None
    assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16]
    ps = prompts(11, seed=12)       # 11 live sequences pad to 16, then fewer as they finish
    params = [SamplingParams(max_tokens=16 + 2 * i, ignore_eos=True) for i in range(11)]
    for want, got in zip(eager.generate(ps, params), graphs.generate(ps, params)):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=5e-3)


def test_both_models_in_one_engine(pair):
    large, small = pair
    both = engine({"large": large, "small": small}, dtype="float32")
    ps = prompts(6, seed=13)
    for name, folder in (("large", large), ("small", small)):
        alone = engine({name: folder}, dtype="float32").generate(ps, GREEDY)
        assert [c.token_ids for c in both.generate(ps, GREEDY, model=name)] == [c.token_ids for c in alone]
    stats = both.stats()
    assert stats["large"]["kv_blocks_free"] == stats["small"]["kv_blocks_free"] == 256


def test_speculative_decoding_on_the_gpu_equals_plain(pair):
    large, small = pair
    ps = prompts(6, seed=14) + [[5, 6, 7, 8, 9] * 6]
    plain = engine({"large": large}, dtype="float32").generate(ps, GREEDY, model="large")
    spec = engine({"large": large, "small": small}, dtype="float32",
                  speculative=SpecConfig(target="large", draft="small", draft_cost=0.1, verify_cost=0.05))
    assert [c.token_ids for c in spec.generate(ps, GREEDY, model="large")] == [c.token_ids for c in plain]
    assert spec.stats()["large"]["speculation"]["verify_passes"] > 0
    # Sampled: the rejection rule runs on the device, with a seeded request's generator moved there.
    sampled = [SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True),
               SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, ignore_eos=True)]
    for c in spec.generate(ps[:2], sampled, model="large"):
        assert c.error is None and c.finish_reason == "length" and len(c.token_ids) == 16


@pytest.mark.parametrize("M", [1, 16, 33])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_layers_on_the_triton_kernels_match_their_float_twins(mode, M):
    torch.manual_seed(0)
    N, K, group = 384, 512, 128
    w, x, b = torch.randn(N, K), torch.randn(M, K), torch.randn(N)
    tensors, deq = quantized(w, mode, group)
    # float32 runs tl.dot in TF32 (operands rounded to 10 mantissa bits): int8 weights survive
    # that exactly, int4's dequantized ones do not. Measured on an H200 at K = 512: 0.067 at most
    # for int4 (1e-4 under TRITON_F32_DEFAULT=ieee); a wrong nibble or scale is off by whole units.
    for dtype, tol in ((torch.float32, 4e-3), (torch.bfloat16, 5e-2)):
        layer = QuantLinear(mode, tensors, b.cuda().to(dtype), group, packed=False, device="cuda")
        got = layer(x.cuda().to(dtype))
        want = x.to(dtype).float() @ deq.T + b.to(dtype).float()
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * K ** 0.5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_on_cuda_follows_the_cpu_one(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_model(tmp_path / "m", "qwen2", seed=3, hidden_size=128, intermediate_size=256)

    prompt = list(range(1, 41))

    def run(device):
        e = LLMEngine(EngineConfig(models={"m": ModelEntry(str(folder), quant=mode, group_size=32)}, device=device,
                                   dtype="float32", max_kv_blocks=64, block_size=16), progress=False)
        return e, e.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    (cpu, want), (gpu, got) = run("cpu"), run("cuda")   # the CPU run writes the stored format; the GPU run reads it
    # CPU: packed ops with bf16 activations; GPU: Triton in TF32. Same weights, close logits; the
    # tiny model's top tokens lie within 0.5 nats, so greedy may take another near-tie (it did
    # for int8 on an H200, picking the float model's own first choice where the CPU did not).
    assert_same_or_near_tie(cpu, prompt, want, got, tol=0.3)
    forced = prompt + [5, 6, 7, 8]
    torch.testing.assert_close(torch.tensor(gpu.score(forced, first=len(prompt))),
                               torch.tensor(cpu.score(forced, first=len(prompt))), rtol=0, atol=0.2)


def test_index_tensors_reach_the_device_in_one_copy_intact():
    from engine.model_runner import PinnedRing, _pack
    ring = PinnedRing(torch.device("cuda", torch.cuda.current_device()))
    ints, floats = [list(range(5)), [1, 2, 3, 4, 5, 6], []], [[0.5, 2.0]]
    got = ring.upload(*_pack(ints, floats))
    assert all(g.is_cuda for g in got) and all(b.is_pinned() for b in ring.buffers if b.numel())
    assert [g.tolist() for g in got[:3]] == ints and got[3].view(torch.float64).tolist() == floats[0]


def test_pinned_ring_reuse_under_async_scheduling_gives_the_synchronous_tokens(tiny_folder):
    """Steps of every size (prompt chunks, decodes, sampled rows) through the ring of two pinned
    buffers while the next step is prepared during the one on the device: the same tokens as
    without async scheduling, and the buffers reused, not reallocated per step."""
    ps = prompts(12, seed=41)
    params = [SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True, temperature=0.8 if i % 3 else 0.0, seed=i)
              for i in range(12)]
    want = engine({"m": tiny_folder}, dtype="float32").generate(ps, params)
    e = engine({"m": tiny_folder}, dtype="float32", async_scheduling=True)
    ring = e.worker("m").runner.inputs
    held, upload = set(), ring.upload

    def counted(flat, sizes):
        out = upload(flat, sizes)
        held.update(b.data_ptr() for b in ring.buffers)
        return out
    ring.upload = counted
    got = e.generate(ps, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert all(b.is_pinned() for b in ring.buffers)
    # Dozens of steps through a few buffers: each slot grows a few times (doubling), never per step.
    assert len(held) <= 8 and e.stats()["m"]["scheduled_ahead"] > 20


def test_sampled_decode_through_graphs_equals_eager_on_cuda(tiny_folder):
    """Seeded sampled requests through the sampled head graphs (LM head, log-softmax, `select`
    on the static rows and noise) against the eager path: the same tokens."""
    ps = prompts(6, seed=42)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=26, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.1, top_p=0.9, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.7, top_k=6, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)]
    eager = engine({"m": tiny_folder}, dtype="float32", cuda_graphs=False).generate(ps, params)
    graphs = engine({"m": tiny_folder}, dtype="float32")
    heads = graphs.worker("m").runner.graphs.heads
    assert {mode for _, mode in heads} == {"greedy", "sampled", "filtered"}
    replays = {"greedy": 0, "sampled": 0, "filtered": 0}
    for (_, mode), graph in heads.items():
        graph.replay = lambda mode=mode, replay=graph.replay: (replays.__setitem__(mode, replays[mode] + 1), replay())
    got = graphs.generate(ps, params)
    for want, have in zip(eager, got):
        assert have.token_ids == want.token_ids
        torch.testing.assert_close(have.logprobs, want.logprobs, rtol=0, atol=5e-3)
    assert replays["sampled"] > 0 and replays["filtered"] > 0, replays


# ---- every Triton kernel at the served models' shapes, on CUDA, against its reference twin ----
# (heads, kv_heads, head_dim, hidden, intermediate) of Qwen2.5-0.5B and -1.5B.
SHAPES = {"0.5b": (14, 2, 64, 896, 4864), "1.5b": (12, 2, 128, 1536, 8960)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "non-finite output (an unwritten element?)"
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def paged_cache(lens: list[int], kvh: int, dh: int, dtype: torch.dtype, int8: bool, block_size: int = 16):
    """Random KV for sequences of `lens` tokens in shuffled blocks of one pool, on CUDA."""
    counts = [-(-n // block_size) for n in lens]
    blocks = torch.randperm(sum(counts), device="cuda")
    tables = torch.zeros(len(lens), max(counts), dtype=torch.long, device="cuda")
    at = 0
    for s, c in enumerate(counts):
        tables[s, :c], at = blocks[at:at + c], at + c
    shape = (sum(counts), block_size, kvh, dh)
    if int8:
        k, v = (torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda") for _ in range(2))
        ks, vs = (torch.rand(shape[:-1], device="cuda") / 64 for _ in range(2))
        return k, v, tables, torch.tensor(lens, device="cuda"), ks, vs
    k, v = (torch.randn(shape, dtype=dtype, device="cuda") for _ in range(2))
    return k, v, tables, torch.tensor(lens, device="cuda"), None, None


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("dtype,int8", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("lens", [[1], [37], [2000], [5, 1200, 16, 700], [300] * 64])
def test_decode_attention_at_engine_shapes(model, dtype, int8, lens):
    from kernels import attention, attention_triton
    heads, kvh, dh, *_ = SHAPES[model]
    torch.manual_seed(len(lens))
    k, v, tables, ctx, ks, vs = paged_cache(lens, kvh, dh, dtype, int8)
    q = torch.randn(len(lens), heads, dh, dtype=dtype, device="cuda")
    want = attention.paged_decode_attention(q.float(), k if int8 else k.float(), v if int8 else v.float(),
                                            tables, ctx, dh ** -0.5, ks, vs)
    for splits in (None, 1, 5):       # automatic (flash-decoding when the chip is not full), none, forced
        got = attention_triton.paged_decode_attention(q, k, v, tables, ctx, dh ** -0.5, ks, vs, num_splits=splits)
        assert rel_err(got, want) < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"num_splits={splits}"


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_attention_launches_at_engine_shapes(model, dtype):
    """A 512-token chunk after a cached prefix, and a fresh prompt, in one call: the kernel
    launches at head_dim 128 in float32 (it once asked for more shared memory than Hopper has)."""
    from kernels import attention, attention_triton
    heads, kvh, dh, *_ = SHAPES[model]
    torch.manual_seed(1)
    k, v, tables, ctx, _, _ = paged_cache([900, 512], kvh, dh, dtype, False)
    starts = torch.tensor([0, 512, 1024], device="cuda")
    q = torch.randn(1024, heads, dh, dtype=dtype, device="cuda")
    want = attention.paged_prefill_attention(q.float(), k.float(), v.float(), tables, ctx, starts, dh ** -0.5)
    got = attention_triton.paged_prefill_attention(q, k, v, tables, ctx, starts, dh ** -0.5)
    assert rel_err(got, want) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("T", [1, 64, 700])
def test_fused_rotary_store_and_activation_at_engine_shapes(model, int8, T):
    from kernels import activation, activation_triton, norm_rope, norm_rope_triton
    heads, kvh, dh, hidden, inter = SHAPES[model]
    torch.manual_seed(T)
    qkv = torch.randn(T, (heads + 2 * kvh) * dh, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.view(T, -1, dh) for t in qkv.split([heads * dh, kvh * dh, kvh * dh], -1))
    angles = torch.rand(T, dh // 2, device="cuda") * 100
    slots = torch.randperm(4 * T, device="cuda")[:T]
    caches = []
    for _ in range(2):
        shape = (4 * T // 16 + 1, 16, kvh, dh)
        kc, vc = (torch.zeros(shape, dtype=torch.int8 if int8 else torch.bfloat16, device="cuda") for _ in range(2))
        scales = [torch.zeros(shape[:-1], device="cuda") for _ in range(2)] if int8 else [None, None]
        caches.append((kc, vc, *scales))
    want_q = norm_rope.rotary_store_kv(q, k, v, angles.cos(), angles.sin(), *caches[0][:2], slots, *caches[0][2:])
    got_q = norm_rope_triton.rotary_store_kv(q, k, v, angles.cos(), angles.sin(), *caches[1][:2], slots, *caches[1][2:])
    assert rel_err(got_q, want_q) < 1e-2
    for want, got in zip(caches[0], caches[1]):
        if want is not None:
            assert (want.float() - got.float()).abs().max() <= (1 if int8 else 0.05)    # int8: one step of rounding
    x = torch.randn(T, 2 * inter, dtype=torch.bfloat16, device="cuda")
    assert rel_err(activation_triton.silu_and_mul(x), activation.silu_and_mul(x)) < 1e-2
    h, r = torch.randn(2, T, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
    for want, got in zip(norm_rope.add_rms_norm(h, r, w, 1e-6), norm_rope_triton.add_rms_norm(h, r, w, 1e-6)):
        assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("M", [1, 5, 16, 64, 300])
def test_quantized_layers_at_engine_shapes(model, M):
    """QuantLinear as a bf16 engine on CUDA runs it (int8: the Triton GEMV, tiles or the dequantized
    cuBLAS path by rows; int4: tinygemm) against the dequantized float layer, over every linear
    shape of the model and its LM head; and the LM head restricted to some rows (a drafter's)."""
    _, _, _, hidden, inter = SHAPES[model]
    heads, kvh, dh = SHAPES[model][:3]
    torch.manual_seed(M)
    for K, N in ((hidden, (heads + 2 * kvh) * dh), (heads * dh, hidden), (hidden, 2 * inter), (inter, hidden),
                 (hidden, 151936)):
        w = torch.randn(N, K, device="cuda") / K ** 0.5
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for mode in ("int8", "int4"):
            tensors, deq = quantized(w, mode, 128)
            layer = QuantLinear(mode, tensors, None, 128, device="cuda", dequant_rows=256)
            assert layer.packed == (mode == "int4")
            want = x.float() @ deq.T
            assert rel_err(layer(x), want) < 1e-2, (mode, K, N)
            if N == 151936 and M == 1:
                ids = torch.arange(0, 4096, device="cuda")
                torch.testing.assert_close(layer.rows(ids)(x), layer(x)[:, ids], rtol=0, atol=0)


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("M", [1, 3, 8, 16, 64])
def test_triton_gemv_at_the_small_projections_shapes(model, M):
    """The Triton GEMV in bf16 against its twin (float32 sums, one rounding) on the q|k|v (with
    Qwen's bias) and o projections: equal but for the sums' order (a bf16 unit or two), the same
    bits at every call and in a graph replay (no atomics), and the twin's plan for this chip."""
    from kernels import gemv, gemv_triton
    heads, kvh, dh, hidden, _ = SHAPES[model]
    torch.manual_seed(M)
    for K, N, bias in ((hidden, (heads + 2 * kvh) * dh, True), (heads * dh, hidden, False)):
        w = (torch.randn(K, N, device="cuda") / K ** 0.5).to(torch.bfloat16)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16) if bias else None
        got = gemv_triton.gemv_linear(x, w, b)
        torch.testing.assert_close(got.float(), gemv.gemv_linear(x, w, b).float(), rtol=2 ** -7, atol=1e-3)
        assert torch.equal(got, gemv_triton.gemv_linear(x, w, b))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv_triton.gemv_linear(x, w, b)
        graph.replay()
        assert torch.equal(out, got)


def test_bf16_engine_on_the_gemv_buckets_follows_the_cpu_one(tiny_folder, tmp_path, monkeypatch):
    """A table naming this device puts the q|k|v and o projections of batches up to 4 on the Triton
    GEMV, captured in those buckets' graphs; the engine shows it and still decodes as the CPU's
    float32 engine does (bf16's near-ties aside)."""
    import json

    from engine import worker
    table = tmp_path / "buckets.json"
    table.write_text(json.dumps({"devices": {torch.cuda.get_device_name(): {"buckets": {
        kind: {"1": "kernel", "4": "kernel", "8": "dense"} for kind in ("bf16.qkv", "bf16.o")}}}}))
    monkeypatch.setattr(worker, "BUCKETS", table)
    gpu = engine({"m": tiny_folder}, dtype="bfloat16")
    assert gpu.stats()["m"]["gemv_buckets"] == {"qkv": [1, 2, 4], "o": [1, 2, 4]}
    assert gpu.worker("m").runner.graphs is not None
    cpu = engine({"m": tiny_folder}, device="cpu")
    ps = prompts(4, seed=5)
    for p, want, got in zip(ps, cpu.generate(ps, GREEDY), gpu.generate(ps, GREEDY)):
        assert_same_or_near_tie(cpu, p, want, got, 0.3)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("M", [1, 16])
def test_quantized_layers_on_the_gemv_at_engine_shapes(mode, M):
    """int8 and fp8 layers on the GEMV (their bytes widened to bf16 in registers, each output's scale
    after the sum) at the 1.5B's q|k|v (with its bias) and gate|up, against x times the weights
    dequantized in float32: equal to bf16's rounding of the output, and a graph replay equal."""
    from engine.quantize import dequantize, quantize_int8
    if mode == "fp8" and not fp8_native(torch.device("cuda")):
        pytest.skip("e4m3 in Triton needs compute capability 8.9 or more")
    heads, kvh, dh, hidden, inter = SHAPES["1.5b"]
    torch.manual_seed(M)
    for N, bias in (((heads + 2 * kvh) * dh, True), (2 * inter, False)):
        w = torch.randn(N, hidden) / hidden ** 0.5
        tensors = dict(zip(("w", "scales"), quantize_fp8(w) if mode == "fp8" else quantize_int8(w)))
        b = torch.randn(N) if bias else None
        layer = QuantLinear(mode, tensors, None if b is None else b.to("cuda", torch.bfloat16), 128, device="cuda",
                            ways=("gemv",) * 17, dtype=torch.bfloat16)
        x = torch.randn(M, hidden, dtype=torch.bfloat16)
        want = x.float() @ dequantize(mode, tensors, 128).T + (0 if b is None else b.bfloat16().float())
        x = x.cuda()    # before the capture: a graph cannot copy from pageable host memory
        got = layer(x)
        torch.testing.assert_close(got.float().cpu(), want, rtol=2 ** -7, atol=2e-3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        graph.replay()
        assert torch.equal(out, got)


def test_int8_engine_on_the_gemv_buckets_follows_its_kernel(tmp_path, monkeypatch):
    """A table giving int8's batches up to 4 to the GEMV: the engine shows them, captures them, and
    decodes as the same engine on int8's own kernel does (near-ties aside). Both are weight-only
    on bf16 activations; the CPU's int8 engine rounds activations to int8 as well, which moves a
    tiny random model's logits by more than bf16 does, so it is not the reference here."""
    import json

    from engine import worker
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_model(tmp_path / "m", "qwen2", seed=3, hidden_size=128, intermediate_size=256)
    prompt = list(range(1, 41))

    def run(way):
        table = tmp_path / f"{way}.json"
        table.write_text(json.dumps({"devices": {torch.cuda.get_device_name(): {"buckets": {
            "int8": {"1": way, "4": way, "8": "kernel"}}}}}))
        monkeypatch.setattr(worker, "BUCKETS", table)
        e = LLMEngine(EngineConfig(models={"m": ModelEntry(str(folder), quant="int8", group_size=32)}, device="cuda",
                                   dtype="bfloat16", max_kv_blocks=64, block_size=16, max_num_seqs=8), progress=False)
        return e, e.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    (kernel, want), (gemv, got) = run("kernel"), run("gemv")
    assert gemv.stats()["m"]["gemv_buckets"]["int8"] == [1, 2, 4]
    assert kernel.stats()["m"]["gemv_buckets"].get("int8", []) == []
    assert_same_or_near_tie(kernel, prompt, want, got, tol=0.1)


@pytest.mark.parametrize("M", [1, 64])
def test_fp8_row_quantization_on_cuda_equals_its_twin_to_the_bit(M):
    """fp8's activations in one Triton launch, bf16 in as the engine gives them, against the
    twin's tensor operations on the same device: the same scales and e4m3 bits."""
    from kernels import quant_matmul, quant_matmul_triton
    torch.manual_seed(M)
    x = (torch.randn(M, 8960, device="cuda") * torch.logspace(-4, 2, M, device="cuda")[:, None]).to(torch.bfloat16)
    q, scale = quant_matmul_triton.quantize_fp8(x)
    want_q, want_scale = quant_matmul.quantize_fp8(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_native(torch.device("cuda")),
                    reason="FP8 tensor cores need compute capability 8.9 or more")
@pytest.mark.parametrize("M", [1, 64, 300])
def test_fp8_layers_on_scaled_mm_match_their_emulation(M):
    """fp8 on torch._scaled_mm (bf16 activations rounded to e4m3 per row) against the float32
    emulation of the same rounding on the CPU, at the 1.5B's shapes and the LM head's: equal to
    bf16's rounding of the output (the sums' order aside); and a graph replay equal to the call."""
    from kernels.quant_matmul import fp8_matmul
    torch.manual_seed(M)
    for K, N in ((1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)):
        w = torch.randn(N, K) / K ** 0.5
        x = torch.randn(M, K).to(torch.bfloat16)
        q, s = quantize_fp8(w)
        layer = QuantLinear("fp8", {"w": q, "scales": s}, None, 128, device="cuda")
        assert layer.scaled_mm and layer.dequant_rows == 0
        got = layer(x.cuda())
        assert rel_err(got, fp8_matmul(x.float(), q, s).cuda()) < 1e-2, (K, N)
        graph, out = torch.cuda.CUDAGraph(), None
        xs = x.cuda()
        with torch.cuda.graph(graph):
            out = layer(xs)
        graph.replay()
        torch.testing.assert_close(out, got, rtol=0, atol=0)


@pytest.mark.anyio
async def test_async_front_on_cuda_reports_cache_and_time_and_stops_cleanly(pair):
    """What the gateway reads from the engine, on a GPU: prefix-cache hits per request, the
    engine seconds billed, the memory plan; and `fail_all` (the drain's last step) ending every
    stream with every KV block back."""
    import asyncio

    from engine.async_engine import AsyncEngine, Stopped
    gpu = engine({"large": pair[0]}, dtype="float32")
    assert "large:" in gpu.memory_plan()
    front = AsyncEngine(gpu)
    shared = [i * 7 % 120 + 1 for i in range(64)]          # 4 full blocks of 16 shared
    outs = [out async for out in front.stream(shared + [3], GREEDY)]
    again = [out async for out in front.stream(shared + [4], GREEDY)]
    assert outs[-1].completion.engine_s > 0 and again[-1].completion.engine_s > 0
    assert outs[0].num_cached_tokens == 0 and again[0].num_cached_tokens >= 48
    total = gpu.stats()["large"]["kv_blocks_total"]
    started = asyncio.Event()

    async def long_stream():
        async for _ in front.stream(prompts(1, seed=18)[0], SamplingParams(max_tokens=2000, ignore_eos=True)):
            started.set()

    tasks = [asyncio.create_task(long_stream()) for _ in range(3)]
    await started.wait()
    await front.fail_all(Stopped("draining"))
    for t in tasks:
        with pytest.raises(Stopped):
            await t
    assert not gpu.requests and gpu.stats()["large"]["kv_blocks_free"] == total
    await front.stop()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("M", [1, 8, 64])      # the Triton kernel up to GGUF_TRITON_ROWS, dequantized past
def test_gguf_layers_on_cuda_match_the_cpu_reference(qtype, M):
    from engine.quantize import GGUFLinear
    from kernels import gguf_quant
    w = gguf_quant.random_blocks(qtype, 1536, 1536)      # the 1.5B's o projection's shape
    x = torch.randn(M, 1536)
    want = gguf_quant.gguf_matmul(x, w, qtype)
    layout, served = gguf_quant.to_planes(qtype, w)      # as apply_gguf hands them to a GPU
    got = GGUFLinear([(layout, served)], None, device="cuda")(x.cuda().to(torch.bfloat16)).float().cpu()
    assert ((got - want).norm() / want.norm()).item() < 0.01     # bf16 activations
