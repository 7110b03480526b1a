"""Async scheduling (EngineConfig.async_scheduling): step N + 1 planned and launched while step
N runs gives exactly the tokens, finish reasons and text of the engine without it (and its
log-probabilities up to float rounding: batches are composed differently), on tiny
random models, across every way a request ends, preemption, chunked prefill, KV windows,
thinking spans and cancellation; an engine with speculation runs synchronously."""
import pytest

from engine.config import EngineConfig, ModelEntry, SpecConfig, ThinkingConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import KVWindow
from tests.test_engine import folder, prompts  # noqa: F401 (a fixture)
from tests.test_engine_faults import assert_all_blocks_free


def make(folder, on: bool, **kw) -> LLMEngine:
    cfg = dict(models={"tiny": ModelEntry(str(folder), thinking=ThinkingConfig(open="t5", close="t6", nudge="t7 "))},
               block_size=4, max_kv_blocks=256, max_num_batched_tokens=64, memory_budget_gb=1.0,
               async_scheduling=on)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), progress=False)


def mixed_params(n: int) -> list[SamplingParams]:
    """Every way a request ends: eos, max_tokens from 1 up, stop strings and tokens; seeded
    sampling; a thinking span (which is never planned ahead)."""
    kinds = [SamplingParams(max_tokens=24),
             SamplingParams(max_tokens=1, ignore_eos=True),
             SamplingParams(max_tokens=2, ignore_eos=True),
             SamplingParams(max_tokens=17, ignore_eos=True, stop=["t3", "t40 t41"]),
             SamplingParams(max_tokens=20, stop_token_ids=[9, 17, 33]),
             SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7),
             SamplingParams(max_tokens=9, ignore_eos=True, max_thinking_tokens=6)]
    return [kinds[i % len(kinds)] for i in range(n)]


def run(engine: LLMEngine, ps: list[list[int]], params: list[SamplingParams], late: int = 4,
        window: KVWindow | None = None) -> tuple[dict[str, tuple], dict[str, list[float]]]:
    """Requests added over the first steps (so admissions meet steps in flight); each one's
    tokens, finish reason and text, and its log-probabilities apart."""
    done, logprobs, added = {}, {}, 0
    while added < len(ps) or engine.has_work():
        for _ in range(late if added else late * 2):
            if added < len(ps):
                engine.add_request(ps[added], params[added], request_id=str(added), window=window)
                added += 1
        for out in engine.step():
            if out.completion:
                c = out.completion
                done[c.request_id] = (c.token_ids, c.finish_reason, c.text)
                logprobs[c.request_id] = c.logprobs
    return done, logprobs


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16},                 # chunked prefill
                                {"max_kv_blocks": 40, "prefix_caching": False}],     # preemption
                         ids=["plain", "chunked", "preempting"])
def test_async_gives_the_same_tokens_as_sync(folder, kw):
    ps, params = prompts(20, seed=61), mixed_params(20)
    sync, on = make(folder, False, **kw), make(folder, True, **kw)
    (want, want_lp), (got, got_lp) = run(sync, ps, params), run(on, ps, params)
    assert got == want
    assert all(got_lp[r] == pytest.approx(want_lp[r], abs=1e-4) for r in want)
    stats = on.stats()["tiny"]
    assert stats["async_scheduling"] and stats["scheduled_ahead"] > 0 and stats["discarded_outputs"] > 0
    assert {r for _, r, _ in got.values()} >= {"stop", "length"}
    if "max_kv_blocks" in kw:
        assert stats["preemptions"] > 0 and sync.stats()["tiny"]["preemptions"] > 0
    assert not sync.stats()["tiny"]["scheduled_ahead"]
    assert_all_blocks_free(on)


def test_async_keeps_kv_windows_exact(folder):
    ps = prompts(6, seed=62)
    params = [SamplingParams(max_tokens=60, ignore_eos=True)] * 6
    window = KVWindow(sinks=4, size=24)
    want = run(make(folder, False), ps, params, window=window)[0]
    on = make(folder, True)
    assert run(on, ps, params, window=window)[0] == want
    assert on.stats()["tiny"]["scheduled_ahead"] > 0


def test_abort_while_in_flight_frees_blocks_and_others_go_on(folder):
    ps = prompts(3, seed=63)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [c.token_ids for c in make(folder, False).generate(ps[1:], params)]
    on = make(folder, True)
    ids = [on.add_request(p, params) for p in ps]
    for _ in range(4):
        on.step()
    assert on.in_flight              # a step is running while the request is cut
    cut = on.abort(ids[0])
    assert cut.finish_reason == "abort"
    done = {}
    while on.has_work():
        done |= {o.request_id: o.completion.token_ids for o in on.step() if o.completion}
    assert ids[0] not in done and [done[i] for i in ids[1:]] == want
    assert_all_blocks_free(on)


def test_score_between_async_steps_matches_sync(folder):
    ids = prompts(1, seed=64)[0] + prompts(1, seed=65)[0]
    on = make(folder, True)
    on.add_request(prompts(1, seed=66)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    on.step(), on.step()
    assert on.score(ids) == pytest.approx(make(folder, False).score(ids), abs=1e-5)


def test_speculation_turns_async_scheduling_off(folder):
    e = make(folder, True, models={"tiny": ModelEntry(str(folder)), "draft": ModelEntry(str(folder))},
             speculative=SpecConfig(target="tiny", draft="draft"))
    assert not e.stats()["tiny"]["async_scheduling"] and e.workers["tiny"].runner.queue is None
