"""Turn a step's logits into next tokens: every row of a step at once (greedy, temperature,
top-k, top-p, per-request seeds), and verification of speculative drafts against the same
distributions.

`select` is tensors of fixed shapes with no read back, so a CUDA graph holds it (the model
runner captures it with the LM head); the CPU runs the same function. It samples by the
exponential race: the token is the argmax of probs / E with E ~ Exp(1) drawn per vocabulary
entry, which picks each token with its probability (the first arrival of independent Poisson
clocks of rates p_i is clock i with probability p_i). Each row's noise comes from its
request's own generator when seeded, so a seeded request's tokens do not depend on which
requests share its steps."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingRows:
    """Per-row sampling parameters as tensors: temperature (0: greedy), top_k (the vocabulary
    size: off), top_p (inf: off; a top_p of 1 is off too, and float32 sums of probabilities
    can pass 1)."""
    temperature: torch.Tensor       # float32 [rows]
    top_k: torch.Tensor             # int64 [rows]
    top_p: torch.Tensor             # float32 [rows]

    @staticmethod
    def host(params: list[SamplingParams], vocab: int) -> tuple[list[float], list[int], list[float]]:
        """The three columns as lists, for a step's one upload."""
        return ([0.0 if p.greedy else p.temperature for p in params],
                [p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                [p.top_p if p.top_p < 1 else math.inf for p in params])

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> SamplingRows:
        t, k, p = cls.host(params, vocab)
        return cls(torch.tensor(t, device=device), torch.tensor(k, device=device), torch.tensor(p, device=device))

    @staticmethod
    def filters(params: list[SamplingParams], vocab: int) -> bool:
        """Whether any non-greedy row uses top-k or top-p (else `probs` skips its sort)."""
        return any(not p.greedy and (0 < p.top_k < vocab or p.top_p < 1) for p in params)

    def __getitem__(self, rows: slice) -> SamplingRows:
        return SamplingRows(self.temperature[rows], self.top_k[rows], self.top_p[rows])


def probs(logits: torch.Tensor, rows: SamplingRows, filtered: bool = True,
          top: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution each row of logits [rows, vocab] samples from: temperature, then top-k
    (every token tied with the k-th largest stays), then top-p (a token is dropped when the mass
    before it, largest first and ties by token id, already reaches top_p; the top token always
    stays, by position: a top_p that float32 rounds to 0 would otherwise drop it too). Where that
    is not a distribution (logits so large that dividing them overflows), the greedy token
    gets all the mass: no request's values can make sampling fail. A greedy row (temperature 0)
    gets its temperature-1 distribution. filtered=False: no row uses top-k or top-p (no sort).
    top: each row's argmax [rows, 1], when already known."""
    t = rows.temperature[:, None]
    x = logits / torch.where(t > 0, t, 1.0)
    if filtered:
        # One sort serves both filters: masking below the k-th value keeps the order of what
        # stays. The filtered values go back to token order by the sort's permutation.
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        sorted_x = sorted_x.masked_fill(sorted_x < sorted_x.gather(1, rows.top_k[:, None] - 1), float("-inf"))
        sorted_probs = sorted_x.softmax(-1)
        drop = sorted_probs.cumsum(-1).sub_(sorted_probs) >= rows.top_p[:, None]
        drop[:, 0] = False
        x = torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill_(drop, float("-inf")))
    out = x.softmax(-1)
    # Values in [0, 1] sum to a finite number unless one is NaN: one pass finds the broken rows,
    # which become one-hot at their argmax (adding 0 leaves every other row as it is).
    bad = out.sum(-1, keepdim=True).isnan()
    top = logits.argmax(-1, keepdim=True) if top is None else top
    return out.masked_fill_(bad, 0.0).scatter_add_(1, top, bad.to(out.dtype))


def select(logits: torch.Tensor, logprobs: torch.Tensor, top: torch.Tensor, rows: SamplingRows,
           noise: torch.Tensor, filtered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token and its log-probability under the model's own distribution (`logprobs`,
    the log-softmax of `logits`), as one [rows, 2] float tensor like `top`, each row's greedy
    pick; and the distributions the sampled rows drew from. Greedy rows keep their pick; the
    others run the race with E = -log U, U the row's uniform noise in [0, 1) (`fill_noise`):
    argmax p / -log U is argmin p / log U, and U = 0 makes a token lose, never win."""
    greedy = top[:, :1].long()
    p = probs(logits, rows, filtered, greedy)
    log_u = torch.log(noise)
    race = torch.div(p, log_u, out=log_u).argmin(-1, keepdim=True)
    token = torch.where(rows.temperature[:, None] > 0, race, greedy)
    return torch.cat([token.float(), logprobs.gather(1, token)], 1), p


def fill_noise(noise: torch.Tensor, generators: list[tuple[int, torch.Generator | None]]) -> None:
    """Uniform noise into the rows of `noise` that sample, (row, generator) each: a seeded
    request's row from its own generator, the others from the default one in one call (rows
    between them that do not sample are filled too: cheaper than gathering). Uniform then
    log in `select` rather than exponential_: on the CPU torch's exponential_ costs several
    uniform_ calls."""
    unseeded = [row for row, g in generators if g is None]
    if unseeded:
        noise[:max(unseeded) + 1].uniform_()
    for row, g in generators:
        if g is not None:
            noise[row].uniform_(generator=g)


def verify(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [k + 1, vocab] of the target at [last, d1..dk]. Returns the accepted drafts
    followed by one token of the target's own (a correction, or a bonus after all k). Eager,
    row by row: each draft's acceptance decides whether the next row is read at all."""
    k = len(draft)
    if params.greedy:
        target = logits.argmax(-1).tolist()
        a = next((i for i in range(k) if draft[i] != target[i]), k)
        return draft[:a] + [target[a]]
    ps = probs(logits, SamplingRows.of([params] * (k + 1), logits.shape[-1], logits.device),
               SamplingRows.filters([params], logits.shape[-1]))
    out = []
    for i, d in enumerate(draft):
        p = ps[i]
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
    out.append(int(torch.multinomial(ps[k], 1, generator=generator)))
    return out
