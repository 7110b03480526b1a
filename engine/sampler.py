"""Turn a step's logits into next tokens, with the chosen token's log-probability."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, top-p.
    Where that is not a distribution (logits so large that dividing them overflows), the
    greedy token gets all the mass: no request's values can make sampling fail."""
    out = _filtered(logits, p).softmax(-1)
    if not bool(torch.isfinite(out).all()):
        out = torch.zeros_like(logits).index_fill_(0, logits.argmax().view(1), 1.0)
    return out


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p. The top token always
        # stays, by index: a top_p that float32 rounds to 0 would otherwise drop it too.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row of logits [vocab]."""
    if p.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits, p), 1, generator=generator))
