import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from tests.test_engine import folder, make_engine, prompts  # noqa: F401  (fixture)

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


async def completion(front, prompt, params):
    """The stream's last output carries the request's completion."""
    return [out async for out in front.stream(prompt, params)][-1].completion


@pytest.mark.anyio
async def test_streams_match_batch_generate(folder):
    ps = prompts(5, seed=4)
    expected = [c.token_ids for c in make_engine(folder).generate(ps, GREEDY)]
    front = AsyncEngine(make_engine(folder))

    async def collect(p):
        return [t async for out in front.stream(p, GREEDY) for t in out.new_token_ids]

    got = await asyncio.gather(*(collect(p) for p in ps))
    await front.stop()
    assert list(got) == expected


@pytest.mark.anyio
async def test_cancelled_stream_frees_blocks_at_once(folder):
    engine = make_engine(folder, prefix_caching=False)
    front = AsyncEngine(engine)
    total = engine.stats()["tiny"]["kv_blocks_total"]
    started = asyncio.Event()

    async def consume():
        async for _ in front.stream(prompts(1)[0], SamplingParams(max_tokens=400, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    assert engine.stats()["tiny"]["kv_blocks_free"] < total
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.stats()["tiny"]["kv_blocks_free"] == total
    assert not engine.requests
    ok = await completion(front, prompts(1)[0], GREEDY)      # and it keeps serving
    assert len(ok.token_ids) == 16
    await front.stop()


@pytest.mark.anyio
async def test_bad_request_raises_and_others_continue(folder):
    front = AsyncEngine(make_engine(folder))
    good = asyncio.create_task(completion(front, prompts(1)[0], GREEDY))
    with pytest.raises(ValueError, match="empty"):
        await completion(front, [], GREEDY)
    assert len((await good).token_ids) == 16
    await front.stop()


@pytest.mark.anyio
async def test_cancel_while_the_request_is_being_queued_leaves_nothing_running(folder):
    import time
    engine = make_engine(folder)
    front = AsyncEngine(engine)
    original = engine.add_request

    def slow_add(*args, **kwargs):
        time.sleep(0.3)                       # the caller gives up meanwhile
        return original(*args, **kwargs)

    engine.add_request = slow_add
    task = asyncio.create_task(completion(front, prompts(1)[0], SamplingParams(max_tokens=400, ignore_eos=True)))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not engine.requests and not engine.has_work()
    await front.stop()


@pytest.mark.anyio
async def test_cut_ends_a_stream_with_what_it_produced(folder):
    from contextlib import aclosing
    p, long = prompts(1, seed=6)[0], SamplingParams(max_tokens=400, ignore_eos=True)
    engine = make_engine(folder)
    front = AsyncEngine(engine)
    got = []
    async with aclosing(front.stream(p, long, request_id="doomed")) as outputs:
        async for out in outputs:
            got += out.new_token_ids
            if len(got) >= 5:
                cut = await front.cut("doomed")
                break
    assert cut.finish_reason == "abort" and cut.token_ids[:len(got)] == got and len(cut.token_ids) < 400
    assert cut.token_ids == make_engine(folder).generate([p], long)[0].token_ids[:len(cut.token_ids)]
    assert not engine.requests and engine.stats()["tiny"]["kv_blocks_free"] == engine.stats()["tiny"]["kv_blocks_total"]
    await front.stop()


@pytest.fixture
def anyio_backend():
    return "asyncio"
