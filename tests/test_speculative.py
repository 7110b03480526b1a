"""Speculative decoding on tiny random models: greedy output identical with and without it,
the rejection rule reproduces the target distribution, rollback leaves the KV cache as a
plain run leaves it, external drafts, and the config checks."""
import pytest
import torch

from engine.config import EngineConfig, ModelEntry, SpecConfig
from engine.llm_engine import LLMEngine
from engine.sampler import verify
from engine.sampling_params import SamplingParams
from engine.speculative import best_k, prompt_lookup
from engine.step import RunnerOutput, SchedulerOutput
from tests.conftest import make_tiny_model, write_word_tokenizer
from tests.test_engine import prompts

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return make_tiny_model(root / "large", "qwen2", seed=1), make_tiny_model(root / "small", "qwen2", seed=2,
                                                                              num_hidden_layers=1)


def engine(large, small=None, **spec):
    models = {"large": ModelEntry(str(large))} | ({"small": ModelEntry(str(small))} if small else {})
    # A fixed draft cost: which k the engine picks must not depend on this machine's timing.
    sc = SpecConfig(target="large", draft="small" if small else None, draft_cost=0.1, verify_cost=0.05, **spec) \
        if spec or small else None
    return LLMEngine(EngineConfig(models=models, block_size=4, max_kv_blocks=256, max_num_batched_tokens=64,
                                  memory_budget_gb=1.0, speculative=sc), progress=False)


def test_greedy_identical_with_draft_model_and_lookup(pair):
    large, small = pair
    ps = prompts(6, seed=21) + [[5, 6, 7, 8, 9] * 6]           # a repetitive one for prompt lookup
    plain = [c.token_ids for c in engine(large).generate(ps, GREEDY, model="large")]
    for kw in ({}, {"prompt_lookup": False}):
        spec = engine(large, small, **kw)
        assert [c.token_ids for c in spec.generate(ps, GREEDY, model="large")] == plain
        stats = spec.stats()["large"]["speculation"]
        assert stats["proposed"] > 0 and stats["verify_passes"] > 0


def test_self_drafting_accepts_everything_and_saves_passes(pair):
    large, _ = pair
    spec = engine(large, large, prompt_lookup=False, max_k=4)
    plain = engine(large).generate(prompts(2, seed=22), GREEDY, model="large")
    got = spec.generate(prompts(2, seed=22), GREEDY, model="large")
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    stats = spec.stats()["large"]["speculation"]
    assert stats["acceptance_rate"] == 1.0
    assert stats["tokens_per_verify_pass"] > 3
    assert spec.stats()["large"]["kv_blocks_free"] == 256 and spec.stats()["small"]["kv_blocks_free"] == 256


def test_rollback_leaves_kv_as_a_plain_run(pair):
    large, small = pair
    p = prompts(1, seed=23)[0]
    caches = []
    for e in (engine(large), engine(large, small)):
        rid = e.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True), model="large")
        seq = e.requests[rid][1]
        while len(seq) < len(p) + 30:
            e.step()
        n = seq.num_computed_tokens
        kc, vc, _, _ = e.workers["large"].runner.kv_caches[0]
        pos = torch.arange(n)
        slots = torch.tensor(seq.block_table)[pos // 4] * 4 + pos % 4
        caches.append((seq.token_ids[:n], kc.view(-1, *kc.shape[2:])[slots], vc.view(-1, *vc.shape[2:])[slots]))
    (ids_a, k_a, v_a), (ids_b, k_b, v_b) = caches
    m = min(len(ids_a), len(ids_b))
    assert ids_a[:m] == ids_b[:m]
    torch.testing.assert_close(k_b[:m], k_a[:m], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_b[:m], v_a[:m], atol=1e-4, rtol=1e-4)


def test_external_draft_gives_own_greedy_output(pair):
    large, _ = pair
    p = prompts(1, seed=24)[0]
    own = engine(large).generate([p], GREEDY, model="large")[0].token_ids
    assert len(set(zip(own, own[1:]))) > 5          # varied output: a shifted draft would be rejected
    accepted = []
    for draft in (own, own[:10] + [(t + 1) % 127 for t in own[10:]]):
        e = engine(large, prompt_lookup=False)
        rid = e.add_request(p, GREEDY, model="large", draft=draft)
        done = {}
        while e.has_work():
            done |= {o.request_id: o.completion for o in e.step() if o.completion}
        assert done[rid].token_ids == own
        stats = e.stats()["large"]["speculation"]["by_source"]["external"]
        accepted.append((stats["proposed"], stats["accepted"]))
    # Every proposed token of the own answer is accepted (all but the last pass's bonus token,
    # and the prefill's when it sampled one); the corrupted one up to where it diverges.
    assert accepted[0][0] == accepted[0][1] >= len(own) - 2
    assert 9 <= accepted[1][1] <= 10


def test_external_draft_without_speculation_is_refused(pair):
    large, _ = pair
    with pytest.raises(ValueError, match="external draft"):
        engine(large).add_request([1, 2, 3], GREEDY, draft=[4, 5])


def test_draft_with_another_tokenizer_is_refused(tmp_path, pair):
    large, _ = pair
    other = make_tiny_model(tmp_path / "other", "qwen2", seed=5)
    write_word_tokenizer(other, 100)           # different vocabulary
    with pytest.raises(ValueError, match="tokenizers differ"):
        engine(large, other)


@pytest.mark.parametrize("model_draft", [True, False])
def test_rejection_rule_reproduces_target_distribution(model_draft):
    g = torch.Generator().manual_seed(0)
    vocab, k, trials = 6, 2, 20000
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=1.0)
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        if model_draft:
            draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
            out = verify(logits, draft, q, params, g)
        else:
            out = verify(logits, [2, 3], None, params, g)      # a fixed proposal, as lookup makes
        counts[out[0]] += 1
    p = torch.softmax(logits[0], -1)
    assert (counts / trials - p).abs().sum() / 2 < 0.02          # total variation distance


def test_prompt_lookup_and_k_choice():
    assert prompt_lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert prompt_lookup([1, 2, 3, 4], 3) == []
    assert best_k(0.9, 0.1, 0.05, 8) >= 4
    assert best_k(0.05, 0.35, 0.05, 8) == 0                     # does not pay: off


def test_speculation_under_preemption_keeps_greedy_output(pair):
    large, small = pair
    ps = prompts(6, seed=25)
    plain = [c.token_ids for c in engine(large).generate(ps, GREEDY, model="large")]
    models = {"large": ModelEntry(str(large)), "small": ModelEntry(str(small))}
    tight = LLMEngine(EngineConfig(models=models, block_size=4, max_kv_blocks=48, max_num_batched_tokens=64,
                                   memory_budget_gb=1.0,
                                   speculative=SpecConfig(target="large", draft="small", draft_cost=0.1,
                                                          verify_cost=0.05)),
                      progress=False)
    assert [c.token_ids for c in tight.generate(ps, GREEDY, model="large")] == plain
    assert tight.stats()["large"]["preemptions"] > 0


def _decode_step(num_draft: int, made: int):
    """One sequence's decode item as the scheduler makes it, and what the target sampled."""
    from types import SimpleNamespace
    item = SimpleNamespace(num_draft=num_draft, num_tokens=1 + num_draft, seq=SimpleNamespace(seq_id=1, spec=None))
    return SchedulerOutput([item]), RunnerOutput([[7] * made], [[0.0] * made], [None], [None])


def test_verification_cost_is_measured_and_switches_speculation_off():
    from engine.speculative import Speculator
    spec = Speculator(SpecConfig(target="large", govern=False), target=None, draft=None)
    for _ in range(30):
        spec.observe_target_step(1.0, *_decode_step(0, 1))      # a plain step
        spec.observe_target_step(3.0, *_decode_step(4, 2))      # verifying 4 drafts costs two more steps
    assert spec.verify_cost == pytest.approx(0.5, abs=0.01)
    # With that cost, a 30% acceptance no longer pays; 80% still does.
    assert best_k(0.3, 0.0, spec.verify_cost, 8) == 0 and best_k(0.8, 0.0, spec.verify_cost, 8) > 0


def test_governor_decides_within_its_bound_and_a_loser_costs_ever_less():
    from engine.speculative import Governor
    arms = ["plain", "lookup", "lookup+model"]
    g = Governor(arms, probe=3, period=8, max_period=256)
    speed = {"plain": 10.0, "lookup": 12.0, "lookup+model": 3.0}     # the draft model loses badly
    ran = []
    for _ in range(9):
        ran.append(arm := g.arm(1))
        g.record(1, arm, tokens=int(speed[arm]), seconds=1.0)
    assert ran == ["plain"] * 3 + ["lookup"] * 3 + ["lookup+model"] * 3     # each arm tried, in order
    ran = []
    for _ in range(2000):
        ran.append(arm := g.arm(1))
        g.record(1, arm, tokens=int(speed[arm]), seconds=1.0)
    assert ran[0] == "lookup" and g.buckets[g.bucket(1)].best == "lookup"
    # Re-tries double their period while they confirm the choice: 2,000 steps hold a handful.
    assert 3 <= ran.count("lookup+model") <= 3 * 8 and ran[-300:].count("lookup") >= 290
    speed["lookup+model"] = 30.0                 # now the draft model pays: picked at its next re-try
    ran = []
    for _ in range(600):
        ran.append(arm := g.arm(1))
        g.record(1, arm, tokens=int(speed[arm]), seconds=1.0)
    assert ran[-100:].count("lookup+model") >= 95
    assert g.bucket(4) not in g.buckets          # batch sizes are judged apart
    assert g.as_dict()["1"]["arm"] == "lookup+model" and g.as_dict()["1"]["probe_period"] <= 256
    assert g.as_dict()["1"]["tok_s"]["plain"] == pytest.approx(10.0)


def test_draft_model_starts_only_where_its_catch_up_pays(pair):
    from engine.sequence import Sequence, SpecState
    large, small = pair
    spec = engine(large, small, prompt_lookup=False, govern=False).speculator
    spec.draft_cost, spec.verify_cost, spec.draft_prefill_cost = 0.35, 0.05, 0.02

    def seq(prompt_len: int, made: int) -> Sequence:
        s = Sequence(list(range(7, 7 + prompt_len)), SamplingParams(max_tokens=512), spec=SpecState())
        s.token_ids += [3] * made
        return s
    # No answers seen yet: the draft model waits until the answer has run as long as its
    # catch-up would take to pay back (0.18 target steps saved per token at acceptance 0.7).
    assert not spec._model_pays(seq(300, 1), 2) and spec._model_pays(seq(300, 40), 2)
    # Short answers seen (RAG): a long prompt never gets the draft model, even at its first step.
    spec.lengths.extend([10] * 16)
    assert not spec._model_pays(seq(300, 1), 2) and not spec._model_pays(seq(300, 8), 2)
    # Long answers seen (reasoning): a short prompt gets it from its first step.
    spec.lengths.extend([200] * 32)
    assert spec._model_pays(seq(60, 1), 2)
    assert spec.expected_remaining(made=1, room=50) == 50          # never past the room left
    # A shadow that is in step costs nothing more to use.
    s = seq(300, 1)
    spec.shadows[s.seq_id] = Sequence(list(s.token_ids), s.params, num_computed_tokens=len(s) - 1)
    assert spec._model_pays(s, 2)
    spec.shadows.clear()


def test_short_answers_keep_the_draft_model_off_in_the_engine(pair):
    """Through the engine: after short answers, a request with a long prompt is answered with
    no draft-model proposal at all, and its output is plain greedy's."""
    large, small = pair
    e = engine(large, small, prompt_lookup=False, govern=False, draft_prefill_cost=0.05)
    e.generate(prompts(10, seed=41), SamplingParams(max_tokens=3, ignore_eos=True), model="large")
    before = e.stats()["large"]["speculation"]["by_source"]["model"]["proposed"]
    long_prompt = [5 + (i * 7) % 50 for i in range(200)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = e.generate([long_prompt], params, model="large")[0].token_ids
    assert e.stats()["large"]["speculation"]["by_source"]["model"]["proposed"] == before
    assert got == engine(large).generate([long_prompt], params, model="large")[0].token_ids
    assert e.stats()["small"]["kv_blocks_free"] == 256           # no shadow was ever made for it


def test_governor_turns_losing_speculation_off_in_the_engine(pair):
    large, small = pair
    e = engine(large, small, prompt_lookup=False)      # every drafting step pays the model's second
    e.speculator.governor.period, e.speculator.governor.probe = 8, 4
    e.speculator.lengths.extend([120] * 8)             # long answers: the draft model starts at once
    # Make every draft-model round cost a second of goodput: drafting then loses to plain decoding.
    slow = e.speculator._draft_with_model

    def slower(*args):
        slow(*args)
        e.speculator.step_draft_seconds += 1.0
    e.speculator._draft_with_model = slower
    ps = prompts(1, seed=31)
    plain = [c.token_ids for c in engine(large).generate(ps, SamplingParams(max_tokens=120, ignore_eos=True),
                                                         model="large")]
    assert [c.token_ids for c in e.generate(ps, SamplingParams(max_tokens=120, ignore_eos=True),
                                            model="large")] == plain
    gov = e.stats()["large"]["speculation"]["governor"]["1"]
    assert gov["arm"] == "plain" and gov["tok_s"]["plain"] > gov["tok_s"]["model"]


def test_draft_vocab_keeps_output_and_drafts_only_its_tokens(pair):
    """The draft model's smaller head (the first 32 ids and the block holding eos) proposes
    only those tokens; verification keeps greedy output the target's own, and sampled requests
    draft from the restricted distribution without error."""
    large, small = pair
    ps = prompts(4, seed=51)
    plain = [c.token_ids for c in engine(large).generate(ps, GREEDY, model="large")]
    e = engine(large, small, prompt_lookup=False, govern=False, draft_vocab=32)
    e.speculator.lengths.extend([200] * 8)              # long answers: the draft model starts at once
    allowed = set(range(32)) | set(range(96, 128))
    drafted = []
    run = e.speculator.draft.runner.run

    def spy(sched, **kw):
        out = run(sched, **kw)
        drafted.extend(t for tokens in out.token_ids for t in tokens)
        return out
    e.speculator.draft.runner.run = spy
    assert [c.token_ids for c in e.generate(ps, GREEDY, model="large")] == plain
    sampled = e.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3), model="large")
    assert all(c.finish_reason == "length" for c in sampled)
    assert drafted and set(drafted) <= allowed
    assert {t for p in plain for t in p} - allowed          # the target wrote tokens no draft could
    assert e.stats()["large"]["speculation"]["draft_vocab"] == 64
    assert e.stats()["large"]["speculation"]["by_source"]["model"]["proposed"] > 0
    assert engine(large, small, draft_vocab=0).speculator.draft_vocab is None


def test_prefill_steps_price_catch_up_and_never_the_decode_step():
    """A prompt chunk costs many decode steps: it must not enter the unit of cost (which made
    drafting look free after every prefill), and until a catch-up is measured it prices one:
    the target's prefill per token, scaled by the draft model's step cost."""
    from types import SimpleNamespace

    from engine.speculative import Speculator
    spec = Speculator(SpecConfig(target="large", govern=False), target=None, draft=None)
    spec.draft_cost = 0.4
    spec.observe_target_step(1.0, *_decode_step(0, 1))               # a plain decode step: 1 s
    prefill = SimpleNamespace(num_draft=0, num_tokens=101, seq=SimpleNamespace(seq_id=1, spec=None))
    spec.observe_target_step(1.0 + 100 * 0.2, SchedulerOutput([prefill]),          # 100 prompt tokens, 0.2 s each
                             RunnerOutput([[7]], [[0.0]], [None], [None]))
    assert spec.target_step == pytest.approx(1.0)
    assert spec.draft_prefill_cost == pytest.approx(0.2 * 0.4)
    spec.observe_target_step(1.3, *_decode_step(2, 3))               # a verification after it
    assert spec.verify_cost == pytest.approx(0.8 * 0.05 + 0.2 * 0.15)
    # The first measured catch-up (50 tokens at 0.05 steps past a draft step) replaces the prior.
    catch_up = SimpleNamespace(num_tokens=51)
    spec._observe_draft_round(0.4 + 50 * 0.05, [catch_up])
    assert spec.draft_prefill_cost == pytest.approx(0.05)
