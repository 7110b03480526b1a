"""Fit ranked chunks into a context budget counted in the answering model's tokens.

The budget covers the whole text of the prompt: the system message (instructions plus the
passages, each with its "[n] title" header and the blank lines between them) and the
question. Only the chat template's role markers, which the engine adds, are outside it.

Chunks are taken by rank. A chunk that mostly repeats one already taken is dropped as a
duplicate; one that does not fit in what is left is dropped for the budget, and smaller,
lower-ranked chunks may still fill the room. The final count is exact: the assembled text
is encoded once more, and chunks are given back, lowest rank first, until it fits.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from .prompt import DEFAULT_INSTRUCTIONS, canonical, passage, system_text
from .types import Chunk, RetrievalError, TokenCounter


@dataclass(frozen=True)
class Dropped:
    chunk_id: str
    reason: str  # "duplicate" or "budget"
    detail: str  # which chunk it repeats, or how many tokens it needed


@dataclass(frozen=True)
class TrimResult:
    chunks: list[Chunk]  # in prompt order: canonical (by document, then position), the lead's first
    dropped: list[Dropped]  # in rank order
    tokens: int  # exact count of the system message plus the question
    budget: int


def trim(ranked: Sequence[Chunk], question: str, budget: int, tokenizer: TokenCounter,
         instructions: str = DEFAULT_INSTRUCTIONS, max_overlap: float = 0.8, lead: Sequence[Chunk] = ()) -> TrimResult:
    """Keep the best chunks that fit in `budget` tokens, `max_overlap` being the share of
    word trigrams a chunk may have in common with a kept one before it counts as a duplicate.
    `lead`: the chunks of a narrower context this one widens. They are taken first (they fit
    a smaller budget, so they fit this one, and the exact count gives back the others first)
    and the prompt puts them first (prompt.canonical), so it extends the narrower prompt."""
    count = lambda text: len(tokenizer.encode(text))
    if not question.strip():
        raise RetrievalError("the question is empty")
    base = count(system_text([], instructions)) + count(question)
    if budget < base:
        raise RetrievalError(f"context budget of {budget} tokens is smaller than the prompt without "
                             f"passages: {base} tokens of instructions and question")
    chosen: list[Chunk] = []
    grams: list[set] = []
    dropped: list[Dropped] = []
    used = base
    first = {c.id for c in lead}
    for c in sorted(ranked, key=lambda c: c.id not in first):     # stable: by rank within each part
        g = _trigrams(c.text)
        twin = next((o for o, og in zip(chosen, grams) if o.id == c.id or _overlap(g, og) > max_overlap), None)
        if twin is not None:
            dropped.append(Dropped(c.id, "duplicate", f"repeats {twin.id}"))
            continue
        # Priced with the widest number it could be given and the blank line before it.
        cost = count("\n\n" + passage(len(ranked), c))
        if used + cost > budget:
            dropped.append(Dropped(c.id, "budget", f"needs about {cost} tokens, {budget - used} left"))
            continue
        chosen.append(c)
        grams.append(g)
        used += cost
    # Subword tokenizers can count a concatenation differently from its parts: check the real text.
    while (tokens := count(system_text(chosen, instructions, lead)) + count(question)) > budget:
        c = chosen.pop()
        dropped.append(Dropped(c.id, "budget", f"the assembled prompt counted {tokens} tokens"))
    return TrimResult(canonical(chosen, lead), dropped, tokens, budget)


def _trigrams(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + 3]) for i in range(max(1, len(words) - 2))} if words else set()


def _overlap(a: set, b: set) -> float:
    """Share of the smaller set found in the other: a passage contained in a kept one is a duplicate."""
    return len(a & b) / min(len(a), len(b)) if a and b else 0.0
