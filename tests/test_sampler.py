"""The batched sampler (engine/sampler.py) against the per-row one it replaced, its draws
against its distributions, and a seeded request's independence from its batch."""
import math

import pytest
import torch
from scipy.stats import chisquare

from engine.model_runner import PinnedRing, _pack
from engine.sampler import SamplingRows, fill_noise, probs, select
from engine.sampling_params import MIN_TEMPERATURE, SamplingParams
from tests.test_engine import folder, make_engine, prompts  # noqa: F401


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The per-row distribution the engine sampled from before the batched sampler: its
    semantics are the batched one's specification. One change: its sort is stable, so ties
    inside the top-p boundary keep the lower token ids, as the batched one does (before, they
    fell to torch.sort's unstable order, which for 1,000 logits kept other ids)."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, stable=True)
        sorted_probs = sorted_x.softmax(-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        drop[0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    out = x.softmax(-1)
    if not bool(torch.isfinite(out).all()):
        out = torch.zeros_like(logits).index_fill_(0, logits.argmax().view(1), 1.0)
    return out


def cases(vocab: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Rows of logits with every kind of parameter: ties at the k-th value and inside the top-p
    boundary, ruled-out tokens (-inf, as a sub-vocabulary's or a ban's), a top_p below every
    probability, and a temperature that overflows the logits (greedy fallback)."""
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)
              for t in (0.3, 1.0, 1.7) for k in (0, 1, 3, 7, vocab, vocab + 5) for p in (1.0, 0.9, 0.5, 1e-9)]
    params += [SamplingParams(temperature=MIN_TEMPERATURE, top_p=0.7), SamplingParams(temperature=MIN_TEMPERATURE)]
    logits = torch.randn(len(params), vocab, generator=g) * 3
    logits[::3, :6] = logits[::3, :1]                    # ties at the top, around the k-th value
    logits[1::3, vocab // 2:] = float("-inf")
    logits[-2:] *= 1e3                                  # divided by 1e-5: past float32's range
    return logits, params


@pytest.mark.parametrize("vocab", [16, 1000])
def test_batched_distributions_equal_the_per_row_ones(vocab):
    logits, params = cases(vocab)
    rows = SamplingRows.of(params, vocab, logits.device)
    got = probs(logits, rows)
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], reference_probs(logits[i], p), rtol=1e-5, atol=1e-7,
                                   msg=lambda m, i=i, p=p: f"row {i} {p}: {m}")
    assert torch.equal(got[-2:], torch.nn.functional.one_hot(logits[-2:].argmax(-1), vocab).float())
    # Without filters the sort is skipped: the same distributions where no row filters.
    plain = [i for i, p in enumerate(params) if not SamplingRows.filters([p], vocab)]
    assert plain and not SamplingRows.filters([params[i] for i in plain], vocab)
    torch.testing.assert_close(probs(logits[plain], SamplingRows.of([params[i] for i in plain], vocab, logits.device),
                                     filtered=False), got[plain], rtol=1e-6, atol=1e-8)


def draw(logits, logprobs, rows, seeds: list[int | None], steps: int) -> list[list[int]]:
    """`steps` selections of each row, its noise from a generator seeded per row (None: the
    default generator), as the runner fills it."""
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    top = torch.stack([logits.argmax(-1).float(), logprobs.max(-1).values], 1)
    noise, out = torch.empty_like(logits), []
    for _ in range(steps):
        fill_noise(noise, list(enumerate(gens)))
        out.append(select(logits, logprobs, top, rows, noise)[0][:, 0].long().tolist())
    return [list(col) for col in zip(*out)]


def test_draws_follow_the_distributions():
    """Empirical frequencies of 40,000 races per row against probs (chi-square over the tokens
    it keeps; none outside them), a fixed seed so it is deterministic."""
    torch.manual_seed(1)
    vocab, n = 12, 40_000
    g = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, top_k=8, top_p=0.9)]
    base = torch.randn(len(params), vocab, generator=g) * 1.5
    logits = base.repeat_interleave(n, 0)
    rows = SamplingRows.of([p for p in params for _ in range(n)], vocab, logits.device)
    noise = torch.empty_like(logits)
    fill_noise(noise, [(r, None) for r in range(len(logits))])
    top = torch.stack([logits.argmax(-1).float(), torch.zeros(len(logits))], 1)
    tokens = select(logits, torch.log_softmax(logits, -1), top, rows, noise)[0][:, 0].long().view(len(params), n)
    want = probs(base, SamplingRows.of(params, vocab, base.device))
    for i in range(len(params)):
        counts = torch.bincount(tokens[i], minlength=vocab).double()
        kept = want[i] > 0
        assert counts[~kept].sum() == 0, f"row {i} drew a filtered-out token"
        expected = want[i][kept].double()
        assert chisquare(counts[kept].numpy(), (expected / expected.sum() * n).numpy()).pvalue > 1e-3
        assert (counts / n - want[i]).abs().sum() / 2 < 0.01          # total variation


def test_a_seeded_row_draws_the_same_alone_or_batched():
    vocab = 300
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, vocab, generator=g) * 2
    logprobs = torch.log_softmax(logits, -1)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=7), SamplingParams(temperature=1.0),
              SamplingParams(), SamplingParams(temperature=0.5, top_k=20, seed=8), SamplingParams(temperature=1.2)]
    rows = SamplingRows.of(params, vocab, logits.device)
    batched = draw(logits, logprobs, rows, [7, None, None, 8, None], 40)
    alone = draw(logits[:1], logprobs[:1], rows[0:1], [7], 40)
    assert batched[0] == alone[0] and len(set(alone[0])) > 1           # the same draws, and not constant
    assert batched[3] == draw(logits[3:4], logprobs[3:4], rows[3:4], [8], 40)[0]
    assert batched[2] == [int(logits[2].argmax())] * 40                # the greedy row takes its argmax
    assert draw(logits[:1], logprobs[:1], rows[0:1], [9], 40)[0] != alone[0]


def test_select_keeps_the_models_own_log_probabilities():
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    logprobs = torch.log_softmax(logits, -1)
    rows = SamplingRows.of([SamplingParams(temperature=0.4, top_k=3)] * 3, vocab, logits.device)
    noise = torch.rand(3, vocab, generator=torch.Generator().manual_seed(5))
    top = torch.stack([logits.argmax(-1).float(), logprobs.max(-1).values], 1)
    picked, dist = select(logits, logprobs, top, rows, noise)
    tokens = picked[:, 0].long()
    assert torch.equal(picked[:, 1], logprobs.gather(1, tokens[:, None]).squeeze(1))     # not the tempered ones
    assert (dist.gather(1, tokens[:, None]) > 0).all() and ((dist > 0).sum(-1) == 3).all()


def test_seeded_requests_draw_the_same_alone_or_batched_with_others(folder):  # noqa: F811
    """Through the engine: a seeded request (temperature, top_p) alone, then among a greedy one,
    an unseeded one, another seeded and a thinking one, in the same steps."""
    engine = make_engine(folder)
    ps = prompts(5, seed=21)
    mine = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    others = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(temperature=1.0, max_tokens=20),
              SamplingParams(temperature=0.7, top_k=9, seed=12, max_tokens=28, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=13, max_tokens=16, max_thinking_tokens=5)]
    alone = engine.generate([ps[0]], mine)[0]
    batched = engine.generate(ps, [mine] + others)
    assert batched[0].token_ids == alone.token_ids and len(set(alone.token_ids)) > 3
    torch.testing.assert_close(batched[0].logprobs, alone.logprobs, rtol=0, atol=1e-4)
    assert all(c.error is None for c in batched)


def test_pinned_ring_rotates_grows_and_hands_out_copies():
    """The ring's bookkeeping off CUDA (no pinning, no events; a CPU copy is a real copy):
    buffers alternate, grow to the largest step, and what a step got stays intact while later
    steps reuse its buffer."""
    ring = PinnedRing(torch.device("cpu"))
    steps = [([list(range(n)), [7] * (n // 2)], [[0.5, -1.25] * (n % 3)]) for n in (3, 10, 4, 40, 5, 6)]
    got = []
    for ints, floats in steps:
        flat, sizes = _pack(ints, floats)
        got.append(ring.upload(flat, sizes))
    for (ints, floats), parts in zip(steps, got):
        assert [p.tolist() for p in parts[:len(ints)]] == ints
        assert [p.view(torch.float64).tolist() for p in parts[len(ints):]] == floats
    # Slots alternate: steps of 4, 8, 11 int64s in one (grown to 4, 8, then doubled to 16),
    # of 17, 62, 9 in the other (17, then 62, which is more than double).
    assert [b.numel() for b in ring.buffers] == [16, 62] and ring.next == 0
    ptr = [b.data_ptr() for b in ring.buffers]
    ring.upload(*_pack([[1, 2]]))
    assert [b.data_ptr() for b in ring.buffers] == ptr          # reused, not reallocated
    flat, sizes = _pack([[]], [[math.pi]])
    assert torch.frombuffer(flat, dtype=torch.float64).tolist() == [math.pi] and sizes == [0, 1]
