"""Fault isolation: one request's failure (hostile sampling values, non-finite logits, a
tokenizer error) finishes that request alone; every other request in the batch (other tenants,
by salt) gets exactly the answer a clean run gives."""
import asyncio

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineFailure
from engine.sampling_params import SamplingParams
from tests.test_async_engine import completion
from tests.test_engine import folder, make_engine, prompts  # noqa: F401  (fixture)

CLEAN = [SamplingParams(max_tokens=16, ignore_eos=True),
         SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=16, ignore_eos=True),
         SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[5])]


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Each request under its own tenant salt, all in one batch; their completions in order."""
    ids = [engine.add_request(p, sp, salt=f"tenant-{i}".encode()) for i, (p, sp) in enumerate(requests)]
    done = {}
    while engine.has_work():
        done |= {o.request_id: o.completion for o in engine.step() if o.completion}
    return [done[i] for i in ids]


def clean_requests(seed=40):
    return list(zip(prompts(3, seed=seed), CLEAN))


def assert_all_blocks_free(engine):
    stats = engine.stats()["tiny"]
    assert not engine.requests and stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("hostile", [dict(temperature=0.7, top_p=1e-300), dict(temperature=1e-138, top_p=0.9),
                                     dict(temperature=1.0, top_p=5e-324)])
def test_hostile_sampling_values_fail_no_one(folder, hostile):
    reqs = clean_requests()
    clean = [c.token_ids for c in run(make_engine(folder), reqs)]
    p = prompts(1, seed=41)[0]
    greedy = make_engine(folder).generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    engine = make_engine(folder)
    *others, bad = run(engine, reqs + [(p, SamplingParams(max_tokens=8, ignore_eos=True, **hostile))])
    assert [c.token_ids for c in others] == clean
    # Such values leave one token in the distribution: the hostile request decodes greedily.
    assert bad.finish_reason == "length" and bad.token_ids == greedy
    assert_all_blocks_free(engine)


def poison_token(completions) -> int:
    """A token that no clean prompt or answer holds."""
    used = {t for c in completions for t in c.prompt_token_ids + c.token_ids}
    unused = sorted(set(range(127)) - used)
    assert unused, "every token is in use; pick shorter requests"
    return unused[0]


def test_non_finite_logits_fail_only_that_request_and_its_kv_is_never_read(folder):
    # A small pool: the failed request's blocks are reused by the others while they decode.
    small = dict(max_kv_blocks=40)
    reqs = clean_requests()
    clean_run = run(make_engine(folder, **small), reqs)
    x = poison_token(clean_run)
    engine = make_engine(folder, **small)
    with torch.no_grad():
        engine.worker("tiny").model.embed_tokens.weight[x] = float("nan")     # NaN hidden states, KV, logits
    poisoned = prompts(1, seed=42)[0][:20] + [x] + [3] * 19
    bad, *others = run(engine, [(poisoned, SamplingParams(max_tokens=16, ignore_eos=True))] + reqs)
    assert bad.finish_reason == "error" and "not finite" in bad.error and bad.token_ids == []
    assert [(c.token_ids, c.finish_reason, c.error) for c in others] == \
           [(c.token_ids, c.finish_reason, None) for c in clean_run]
    assert_all_blocks_free(engine)
    # It keeps serving, from the same (recycled) blocks, with the same answers.
    assert [c.token_ids for c in run(engine, reqs)] == [c.token_ids for c in clean_run]
    assert_all_blocks_free(engine)


def test_no_decode_reads_a_failing_requests_blocks_through_its_padding(folder):
    # Attention reads padded block-table entries too (masked, and 0 * NaN is NaN). Arranged
    # so that a poisoned prefill writes block 0, the first block, while two requests of
    # unequal length decode beside it in the same step.
    pool = dict(max_kv_blocks=20, prefix_caching=False)
    b, c = prompts(1, seed=46)[0][:1] * 37, prompts(1, seed=47)[0][:1] * 33    # 10 and 9 blocks
    three = SamplingParams(max_tokens=3, ignore_eos=True)                       # no block more
    clean = run(make_engine(folder, **pool), [(b, three), (c, three)])
    x = poison_token(clean)
    engine = make_engine(folder, **pool)
    with torch.no_grad():
        engine.worker("tiny").model.embed_tokens.weight[x] = float("nan")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))                 # takes block 0, then ends
    ids = [engine.add_request(p, three, salt=s) for p, s in ((b, b"b"), (c, b"c"))]
    engine.step(), engine.step()
    assert list(engine.worker("tiny").block_manager.free) == [0]
    bad = engine.add_request([x, 1, 2], SamplingParams(max_tokens=4), salt=b"hostile")
    done = {}
    while engine.has_work():
        done |= {o.request_id: o.completion for o in engine.step() if o.completion}
    assert done[bad].finish_reason == "error"
    assert [done[i].token_ids for i in ids] == [c.token_ids for c in clean]


def test_a_tokenizer_error_fails_only_that_request(folder):
    reqs = clean_requests()
    clean_run = run(make_engine(folder), reqs)
    p = prompts(1, seed=43)[0]
    own = make_engine(folder).generate([p], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    others_out = {t for c in clean_run for t in c.token_ids}
    x = next(t for t in own[2:] if t not in others_out)
    engine = make_engine(folder)
    tok = engine.worker("tiny").tokenizer
    decode = tok.decode

    def broken(ids):
        if x in ids:
            raise ValueError(f"cannot decode token {x}")
        return decode(ids)
    tok.decode = broken
    bad, *others = run(engine, [(p, SamplingParams(max_tokens=16, ignore_eos=True))] + reqs)
    assert bad.finish_reason == "error" and f"cannot decode token {x}" in bad.error
    assert bad.token_ids == own[:own.index(x) + 1]
    assert [c.token_ids for c in others] == [c.token_ids for c in clean_run]
    assert_all_blocks_free(engine)


@pytest.mark.anyio
async def test_a_failed_stream_raises_alone_and_the_others_go_on(folder):
    reqs = clean_requests()
    clean = [c.token_ids for c in run(make_engine(folder), reqs)]
    x = poison_token(run(make_engine(folder), reqs))
    engine = make_engine(folder)
    with torch.no_grad():
        engine.worker("tiny").model.embed_tokens.weight[x] = float("nan")
    front = AsyncEngine(engine)

    async def collect(p, sp, salt):
        return [t async for out in front.stream(p, sp, salt=salt) for t in out.new_token_ids]

    tasks = [collect(p, sp, f"tenant-{i}".encode()) for i, (p, sp) in enumerate(reqs)]
    tasks.append(collect([x, 4, 5], SamplingParams(max_tokens=8), b"hostile"))
    *got, failure = await asyncio.gather(*tasks, return_exceptions=True)
    await front.stop()
    assert got == clean
    assert isinstance(failure, EngineFailure) and "not finite" in str(failure)
    assert_all_blocks_free(engine)


@pytest.mark.anyio
async def test_a_step_that_fails_as_a_whole_fails_what_was_in_flight_and_serving_goes_on(folder):
    engine = make_engine(folder)
    front = AsyncEngine(engine)
    runner = engine.worker("tiny").runner
    forward = runner._forward        # the step's model call, whichever path runs it
    calls = 0

    def fails_once(*args):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device lost")
        return forward(*args)
    runner._forward = fails_once
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    results = await asyncio.gather(*(completion(front, p, long) for p in prompts(2, seed=44)), return_exceptions=True)
    assert all(isinstance(r, EngineFailure) and "device lost" in str(r) for r in results)
    assert_all_blocks_free(engine)
    ok = await completion(front, prompts(1, seed=45)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(ok.token_ids) == 4
    await front.stop()


@pytest.fixture
def anyio_backend():
    return "asyncio"
