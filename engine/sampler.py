"""Turn a step's logits into next tokens, with the chosen token's log-probability."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, top-p."""
    return _filtered(logits, p).softmax(-1)


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """logits [N, vocab] float32. Log-probabilities are of the model's own distribution
    (before temperature and filtering), which is what confidence estimates need."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = torch.multinomial(probs(logits[i], p), 1, generator=generators[i]).item()
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()
