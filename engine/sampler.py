"""Turn a step's logits into next tokens: sampling (greedy, temperature, top-k, top-p,
per-request seeds), and verification of speculative drafts against the same distributions."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, top-p.
    Where that is not a distribution (logits so large that dividing them overflows), the
    greedy token gets all the mass: no request's values can make sampling fail."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        sorted_probs = sorted_x.softmax(-1)
        # Drop a token when the mass before it already reaches top_p. The top token always
        # stays, by index: a top_p that float32 rounds to 0 would otherwise drop it too.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        drop[0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    out = x.softmax(-1)
    if not bool(torch.isfinite(out).all()):
        out = torch.zeros_like(logits).index_fill_(0, logits.argmax().view(1), 1.0)
    return out


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row of logits [vocab]."""
    if p.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits, p), 1, generator=generator))


def verify(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [k + 1, vocab] of the target at [last, d1..dk]. Returns the accepted drafts
    followed by one token of the target's own (a correction, or a bonus after all k)."""
    k = len(draft)
    if params.greedy:
        target = logits.argmax(-1).tolist()
        a = next((i for i in range(k) if draft[i] != target[i]), k)
        return draft[:a] + [target[a]]
    out = []
    for i, d in enumerate(draft):
        p = probs(logits[i], params)
        q = draft_probs[i] if draft_probs is not None else None     # None: a deterministic proposal
        q_d = q[d].item() if q is not None else 1.0
        if torch.rand((), generator=generator, device=p.device).item() * q_d < p[d].item():
            out.append(d)
            continue
        residual = (p - q).clamp(min=0) if q is not None else p.index_fill(0, torch.tensor([d], device=p.device), 0.0)
        if residual.sum() <= 0:        # p == q: nothing left to correct towards
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs(logits[k], params), 1, generator=generator)))
    return out
