"""KV windows with attention sinks (StreamingLLM) on tiny random models, each checked against
a plain-PyTorch decoder that recomputes the same windowed attention from scratch: every
query attends to the sinks and its window's recent tokens, at cache-relative rotary
positions. Also the int8 sinks' one rounding, a shared prefix while a window drops, speculative
decoding, flat memory, the window's checks, and the tenant policy through HTTP."""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from litestar.testing import TestClient

from engine import KVWindow
from engine.sampling_params import SamplingParams
from gateway.config import ConfigError
from gateway.http.app import create_app
from gateway.tenants import load_tenant
from kernels import rotate_keys
from kernels.attention import quantize_kv
from kernels.norm_rope import apply_rotary
from tests.conftest import make_tiny_model
from tests.test_engine import make_engine
from tests.test_gateway_support import KEYS, auth, embedder, llm, make_gateway, tenant_toml, wait_ready  # noqa: F401
from tests.test_speculative import engine as spec_engine

BS = 4          # the tiny engines' block size
GREEDY = SamplingParams(max_tokens=60, ignore_eos=True)


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 127, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model, ids: list[int], window: KVWindow | None, starts: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of a decoder whose token t attends to the sinks and the tokens its
    window keeps, the window taken at the first token of t's step (`starts`: each step's first
    position). A kept key after the sinks sits at its position less what was dropped; the
    query too. Built from the model's weights alone: its own attention, norms and MLP."""
    cfg, T = model.cfg, len(ids)
    step = [max(s for s in starts if s <= t) for t in range(T)]
    dropped = [window.dropped(s, BS) if window else 0 for s in step]
    sinks = window.sink_tokens(BS) if window else 0
    cos_table, sin_table = model.rotary.cos, model.rotary.sin
    t, j, d = torch.arange(T)[:, None], torch.arange(T)[None, :], torch.tensor(dropped)[:, None]
    seen = (j <= t) & ((j < sinks) | (j >= sinks + d))
    kpos = torch.where(j < sinks, j, (j - d).clamp(min=0)).T       # [key, query]: key j as query t sees it
    qpos = t[:, 0] - d[:, 0]

    def norm(x, w):
        return F.rms_norm(x, x.shape[-1:], w, eps=cfg.rms_norm_eps)

    def linear(x, lin):
        return x @ lin.weight_t + (lin.bias if lin.bias is not None else 0)

    x = model.embed_tokens.weight[torch.tensor(ids)]
    for layer in model.layers:
        a = layer.self_attn
        q, k, v = linear(norm(x, layer.input_layernorm.weight), a.qkv_proj).split(
            [a.h * a.d, a.kvh * a.d, a.kvh * a.d], -1)
        q, k, v = q.view(T, a.h, a.d), k.view(T, a.kvh, a.d), v.view(T, a.kvh, a.d)
        if a.q_norm is not None:
            q, k = norm(q, a.q_norm.weight), norm(k, a.k_norm.weight)
        g = a.h // a.kvh
        kt = apply_rotary(k.repeat_interleave(T, 0), cos_table[kpos.flatten()], sin_table[kpos.flatten()])
        kt = kt.view(T, T, a.kvh, a.d).transpose(0, 1).repeat_interleave(g, 2)     # [query, key, head, d]
        qt = apply_rotary(q, cos_table[qpos], sin_table[qpos])
        scores = torch.einsum("thd,tjhd->thj", qt, kt) * a.scale
        p = torch.softmax(scores.masked_fill(~seen[:, None, :], float("-inf")), -1)
        out = torch.einsum("thj,jhd->thd", p, v.repeat_interleave(g, 1))
        x = x + out.reshape(T, -1) @ a.o_proj.weight_t
        gate, up = linear(norm(x, layer.post_attention_layernorm.weight), layer.mlp.gate_up_proj).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ layer.mlp.down_proj.weight_t
    return norm(x, model.norm.weight) @ model.lm_head.weight_t


def reference_logprobs(model, ids, window, starts) -> torch.Tensor:
    """Log-probability of each token from index 1 on, under reference_logits."""
    lp = torch.log_softmax(reference_logits(model, ids, window, starts)[:-1], -1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen2w"), "qwen2", seed=3)


@pytest.mark.parametrize("window", [KVWindow(sinks=4, size=24), KVWindow(sinks=0, size=16),
                                    KVWindow(sinks=6, size=20)])
def test_windowed_scores_equal_the_reference(tiny_folder, window):
    """Prompt chunks of 8 over 120 tokens: many drops, each re-rotating the kept keys; every
    architecture (Qwen3's q/k norms come before the rotation that is undone)."""
    engine = make_engine(tiny_folder, max_num_batched_tokens=8)
    ids = tokens(120, seed=1)
    got = torch.tensor(engine.score(ids, window=window))
    model = engine.workers["tiny"].model
    want = reference_logprobs(model, ids, window, list(range(0, 120, 8)))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    full = torch.tensor(engine.score(ids))
    assert (got - full).abs().max() > 1e-2        # the window did change what was seen
    assert engine.stats()["tiny"]["kv_blocks_free"] == 256


def test_window_past_the_sequence_changes_nothing(folder):
    engine = make_engine(folder)
    ids = tokens(60, seed=2)
    assert engine.score(ids, window=KVWindow(sinks=4, size=64)) == pytest.approx(engine.score(ids), abs=1e-5)


def test_windowed_decode_equals_the_reference_with_flat_memory(folder):
    """A 30-token prompt decoding 60 more through a 24-token window: each token's log-probability
    equals the reference's, where each decode is its own step; the sequence never holds more
    blocks than the window's plus the one being filled."""
    engine = make_engine(folder)
    window = KVWindow(sinks=4, size=24)
    prompt = tokens(30, seed=4)
    rid = engine.add_request(prompt, GREEDY, window=window)
    seq, held = engine.requests[rid][1], []
    done = None
    while done is None:
        held.append(len(seq.block_table) + len(seq.sink_source))
        for out in engine.step():
            done = out.completion or done
    ids = prompt + done.token_ids
    want = reference_logprobs(engine.workers["tiny"].model, ids, window, [0] + list(range(30, len(ids))))
    torch.testing.assert_close(torch.tensor(done.logprobs), want[29:], atol=2e-4, rtol=1e-4)
    assert max(held) <= 24 // BS + 1 + 1     # the window's blocks, the one being filled, the sinks' original
    assert done.num_evicted_tokens == window.dropped(len(ids) - 2, BS) > 0
    plain = make_engine(folder).generate([prompt], GREEDY)[0]
    assert plain.num_evicted_tokens == 0 and plain.token_ids != done.token_ids


def test_int8_sinks_are_rounded_once_not_at_every_drop():
    """The engine rotates a window's sinks from their untouched original by the whole distance
    dropped: against the float keys rotated so, a key pair is off by at most its two roundings
    (the original's and the copy's, half a scale step per value each; a rotation keeps a
    pair's error norm). Rotating keys in place at every drop instead (50 drops here) rounds
    each time, and a small rotation rounds back to where it was, so the error grows with the
    drops: measured here many times larger."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(6, BS, 2, 16, generator=g) * 3
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    q, s = quantize_kv(keys.flatten(0, 1))
    cache = torch.cat([q.view(keys.shape), torch.zeros_like(q.view(keys.shape))])
    scale = torch.cat([s.view(keys.shape[:-1]), torch.zeros_like(s.view(keys.shape[:-1]))])
    src, dst, steps = torch.arange(6), torch.arange(6, 12), 50
    angle = steps * BS * inv
    rotate_keys(cache, src, dst, angle.cos(), angle.sin(), scale)
    want = apply_rotary(keys.flatten(0, 1), angle.cos().expand(len(keys) * BS, -1),
                        angle.sin().expand(len(keys) * BS, -1)).view(keys.shape)

    def pair_err(c, sc):
        err = c.float() * sc[..., None] - want
        return (err[..., :8] ** 2 + err[..., 8:] ** 2).sqrt()

    once = pair_err(cache[dst], scale[dst])
    assert (once <= math.sqrt(2) / 2 * (scale[src] + scale[dst])[..., None] + 1e-6).all()
    for _ in range(steps):          # the other way: in place, a drop at a time
        rotate_keys(cache, src, src, torch.cos(BS * inv), torch.sin(BS * inv), scale)
    assert pair_err(cache[src], scale[src]).max() > 5 * once.max()
    # A float cache is rotated exactly (to float32 rounding).
    flt = torch.cat([keys, torch.zeros_like(keys)])
    rotate_keys(flt, src, dst, angle.cos(), angle.sin())
    torch.testing.assert_close(flt[dst], want, atol=1e-5, rtol=1e-5)


def test_int8_windowed_scores_stay_close_to_the_float_reference(folder):
    engine = make_engine(folder, kv_cache_dtype="int8", max_num_batched_tokens=8)
    window, ids = KVWindow(sinks=4, size=24), tokens(120, seed=5)
    got = torch.tensor(engine.score(ids, window=window))
    want = reference_logprobs(engine.workers["tiny"].model, ids, window, list(range(0, 120, 8)))
    plain_int8 = torch.tensor(engine.score(ids))      # int8 KV without a window, for scale
    full = reference_logprobs(engine.workers["tiny"].model, ids, None, [0])
    drift, base = (got - want).abs().mean(), (plain_int8 - full).abs().mean()
    assert drift < 3 * base + 1e-3, (drift, base)


def test_a_window_never_writes_a_shared_prefix(folder):
    """Two requests share a 40-token prefix; the windowed one drops blocks of it and moves its
    sinks to rotated copies while the other still reads them: the other's output is its own,
    the windowed one's is as alone, and what stays in the prefix cache is valid (a later
    request served from it answers as a cold engine does)."""
    prefix = tokens(40, seed=6)
    a, b = prefix + [1, 2], prefix + [3, 4, 5]
    window = KVWindow(sinks=4, size=24)
    alone = make_engine(folder).generate([b], GREEDY)[0].token_ids
    engine = make_engine(folder, max_num_batched_tokens=64)
    ra = engine.add_request(a, GREEDY, window=window, request_id="a")
    rb = engine.add_request(b, GREEDY, request_id="b")
    bm = engine.workers["tiny"].block_manager
    done = {}
    while len(done) < 2:
        for out in engine.step():
            if out.completion:
                done[out.request_id] = out.completion
    assert done[rb].token_ids == alone
    assert done[ra].num_evicted_tokens > 0
    # The windowed sequence alone gives the same tokens: sharing changed nothing for it either.
    cold = make_engine(folder)
    cold.add_request(a, GREEDY, window=window)
    got_alone = None
    while got_alone is None:
        got_alone = next((o.completion for o in cold.step() if o.completion), None)
    assert done[ra].token_ids == got_alone.token_ids
    assert bm.num_free == 256
    # Nothing re-rotated is left in the cache: every cached block's tokens are a prefix of a or b.
    for h, block_id in bm.cached.items():
        ids = bm.blocks[block_id].token_ids
        assert any(ids == s[i:i + BS] for s in (a + done[ra].token_ids, b + done[rb].token_ids)
                   for i in range(0, len(s), BS))
    again = engine.generate([a], GREEDY)[0]      # served from what the cache kept
    assert again.token_ids == make_engine(folder).generate([a], GREEDY)[0].token_ids


def test_greedy_speculative_decoding_with_a_window_equals_plain_windowed(tmp_path):
    large = make_tiny_model(tmp_path / "large", "qwen2", seed=1)
    small = make_tiny_model(tmp_path / "small", "qwen2", seed=2, num_hidden_layers=1)
    window, ps = KVWindow(sinks=4, size=24), [tokens(30, seed=7), tokens(10, seed=8) * 3]
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    def run(e):
        ids = [e.add_request(p, params, model="large", window=window) for p in ps]
        done = {}
        while len(done) < len(ids):
            done |= {o.request_id: o.completion for o in e.step() if o.completion}
        return [done[i].token_ids for i in ids]

    plain = run(spec_engine(large))
    for kw in ({}, {"prompt_lookup": False}):
        spec = spec_engine(large, small, **kw)
        assert run(spec) == plain
        assert spec.stats()["large"]["speculation"]["verify_passes"] > 0
        assert spec.stats()["small"]["kv_blocks_free"] == 256


def test_bad_windows_are_refused_with_the_key_named(folder):
    engine = make_engine(folder)
    for window, key in ((KVWindow(sinks=-1, size=32), "sinks"), (KVWindow(sinks=4, size=7), "window"),
                        (KVWindow(sinks=5, size=11), "window"), (KVWindow(sinks=0, size=10**6), "window")):
        with pytest.raises(ValueError, match=key):
            engine.add_request([1, 2, 3], GREEDY, window=window)
        with pytest.raises(ValueError, match=key):
            engine.score([1, 2, 3], window=window)
    assert KVWindow(sinks=5, size=12).errors(BS, 512) == []
    assert [key for key, _ in KVWindow(sinks=-1, size=3).errors(BS, 512)] == ["sinks", "window"]


# ------------------------------------------------------------- the tenant policy, through HTTP

def test_a_window_tenant_answers_a_30_turn_chat_past_its_budget(tmp_path, llm, embedder):
    """A conversation that outgrows a 64-token context budget: the "window" tenant answers all
    30 turns, saying how many tokens its KV window dropped, and the metric counts them; the
    "reject" tenant (the default) refuses the same conversation once it is over the budget."""
    window = tenant_toml(KEYS["alpha"], context=64, output=8) + '\n[long_context]\npolicy = "window"\nsinks = 4\n'
    gateway = make_gateway(tmp_path, llm, embedder, {"alpha": window, "beta": tenant_toml(KEYS["beta"], context=64)})
    messages, evicted, refused = [], [], 0
    with TestClient(create_app(gateway)) as client:
        wait_ready(client)
        for turn in range(30):
            messages.append({"role": "user", "content": f"t{turn + 1} t{turn + 2} t{turn + 3} t{turn + 4}"})
            body = {"model": "small", "messages": messages, "max_tokens": 4}
            r = client.post("/v1/chat/completions", json=body, headers=auth("alpha"))
            assert r.status_code == 200, r.text
            evicted.append(r.json()["sluice"]["evicted_tokens"])
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            other = client.post("/v1/chat/completions", json=body, headers=auth("beta"))
            if other.status_code == 400:         # a 422 is a 400 on the OpenAI-shaped endpoint
                assert other.json()["error"]["code"] == "over_context_budget", other.text
                refused += 1
            else:
                assert other.status_code == 200
        metrics = client.get("/metrics").text
    assert evicted[0] is None and evicted[-1] > 0          # fits at first; later the window drops tokens
    assert refused >= 20
    assert sum(e is not None for e in evicted) == refused    # windowed exactly where the other was refused
    counted = re.search(r'sluice_kv_evicted_tokens_total\{tenant="alpha",model="small"\} (\d+)', metrics)
    assert counted and int(counted.group(1)) == sum(e or 0 for e in evicted)


def test_long_context_keys_are_checked_by_name(tmp_path):
    for table, key in (('policy = "window"\nsinks = -1', "long_context.sinks"),
                       ('policy = "window"\nsinks = 20\nwindow = 40', "long_context.window"),
                       ('policy = "stream"', "long_context.policy")):
        path = tmp_path / "t.toml"
        path.write_text(tenant_toml(KEYS["alpha"], context=400) + f"\n[long_context]\n{table}\n")
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_tenant(path, {"small", "large"})
    path.write_text(tenant_toml(KEYS["alpha"], context=400) + '\n[long_context]\npolicy = "window"\n')
    assert load_tenant(path, {"small", "large"}).terms.window == KVWindow(4, 400)
