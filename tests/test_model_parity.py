"""Sluice's logits against transformers' for tiny random Llama, Qwen2 and Qwen3 models:
prefill, decode, chunked prefill across block boundaries, and prefix-cache hits; each on the
kernels' PyTorch twins and on the compiled CPU kernels."""
import pytest
import torch
import transformers

import kernels
from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.model import load_model
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step import ScheduledSeq

BLOCK = 4


class Harness:
    """Drives the model runner by hand so every position's logits can be read."""

    def __init__(self, folder, num_blocks=64):
        cfg = ModelConfig.from_folder(folder)
        self.model = load_model(folder, cfg)
        self.bm = BlockManager(num_blocks, BLOCK)
        self.runner = ModelRunner(self.model, cfg, num_blocks, BLOCK)

    def new_seq(self, ids, salt=b""):
        seq = Sequence(list(ids), SamplingParams(), salt=salt)
        self.bm.allocate(seq)
        seq.num_computed_tokens = seq.num_cached_tokens     # as the scheduler admits it
        return seq

    def step(self, items: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """Run one step; returns each item's logits for all of its tokens."""
        for seq, _ in items:
            assert self.bm.resize(seq, len(seq))
        scheduled = [ScheduledSeq(s, s.num_computed_tokens, n, s.num_computed_tokens + n == len(s))
                     for s, n in items]
        with torch.inference_mode():
            ids, pos, batch, _ = self.runner.prepare(scheduled)
            logits = self.model.logits(self.model(ids, pos, batch))
        out, row = [], 0
        for seq, n in items:
            out.append(logits[row:row + n])
            row += n
            seq.num_computed_tokens += n
            self.bm.register_computed(seq)
        return out


@pytest.fixture(autouse=True, params=["twins", "compiled"])
def cpu_kernels(request):
    ops = kernels.cpu_ops(request.param == "compiled")
    if request.param == "compiled" and ops is None:
        pytest.skip("the compiled CPU kernels cannot be built here (no AVX2, C++ compiler or ninja)")
    with kernels.with_cpu_ops(ops):     # the model is called by hand here, outside a runner
        yield


@pytest.fixture(scope="module")
def reference(tiny_folder):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()


def ref_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def test_prefill_matches(tiny_folder, reference):
    h = Harness(tiny_folder)
    ids = torch.randint(0, 127, (23,)).tolist()
    seq = h.new_seq(ids)
    (got,) = h.step([(seq, len(ids))])
    torch.testing.assert_close(got, ref_logits(reference, ids), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_then_decode_across_blocks(tiny_folder, reference):
    h = Harness(tiny_folder)
    ids = torch.randint(0, 127, (30,)).tolist()
    seq = h.new_seq(ids[:17])
    chunks = [h.step([(seq, n)])[0] for n in (5, 7, 5)]     # chunk edges fall inside blocks
    for t in ids[17:]:                                        # decode one token at a time
        seq.token_ids.append(t)
        chunks.append(h.step([(seq, 1)])[0])
    torch.testing.assert_close(torch.cat(chunks), ref_logits(reference, ids), atol=1e-4, rtol=1e-4)


def test_mixed_step_of_decodes_and_prefills(tiny_folder, reference):
    h = Harness(tiny_folder)
    a_ids, b_ids, c_ids = (torch.randint(0, 127, (n,)).tolist() for n in (9, 14, 6))
    a, b = h.new_seq(a_ids[:-1]), h.new_seq(b_ids[:-1])
    h.step([(a, len(a)), (b, len(b))])
    a.token_ids.append(a_ids[-1])
    b.token_ids.append(b_ids[-1])
    c = h.new_seq(c_ids)
    got_a, got_b, got_c = h.step([(a, 1), (b, 1), (c, len(c_ids))])
    torch.testing.assert_close(got_a[0], ref_logits(reference, a_ids)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b[0], ref_logits(reference, b_ids)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_c, ref_logits(reference, c_ids), atol=1e-4, rtol=1e-4)


def test_prefix_cache_hit_gives_same_logits(tiny_folder, reference):
    h = Harness(tiny_folder)
    prefix = torch.randint(0, 127, (13,)).tolist()
    first = h.new_seq(prefix + [5, 6, 7])
    h.step([(first, len(first))])
    ids = prefix + [9, 10, 11, 12]
    second = h.new_seq(ids)
    assert second.num_cached_tokens == 12            # three full blocks of the shared prefix
    (got,) = h.step([(second, len(ids) - 12)])
    torch.testing.assert_close(got, ref_logits(reference, ids)[12:], atol=1e-4, rtol=1e-4)
    other_tenant = h.new_seq(ids, salt=b"tenant-b")
    assert other_tenant.num_cached_tokens == 0


def test_tied_embeddings_and_rope_scaling(tmp_path):
    from tests.conftest import make_tiny_model
    folder = make_tiny_model(tmp_path, "llama", tie=True, rope_theta=500.0, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    h = Harness(folder)
    ids = torch.randint(0, 127, (100,)).tolist()
    (got,) = h.step([(h.new_seq(ids), len(ids))])
    torch.testing.assert_close(got, ref_logits(ref, ids), atol=1e-4, rtol=1e-4)
