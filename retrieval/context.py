"""The context of one question, composed as /v1/ask composes it: search the collection, trim
the hits to the context budget, build the prompt, and put the passages in front of the
question (or of a chat conversation). The gateway serves with it and evals measure with it,
so an offline score is the score of what the service would have answered."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from .prompt import build_prompt
from .select import Selector, words
from .trim import TrimResult, trim
from .types import Chunk, RetrievalError, SearchHit, TokenCounter

CITE = re.compile(r"\[(\d+)\]")


class OverBudget(RetrievalError):
    """The question (or conversation) alone, with no passages to give up, exceeds the budget."""

    def __init__(self, tokens: int, budget: int, what: str):
        super().__init__(f"the {what} is {tokens} tokens; the context budget is {budget}")
        self.tokens, self.budget, self.what = tokens, budget, what


@dataclass(frozen=True)
class Passage:
    number: int        # as the prompt numbers the passage, and the answer cites it: [1]
    hit: SearchHit


@dataclass(frozen=True)
class RagContext:
    messages: list[dict[str, str]]   # for the chat template
    citations: list[Passage]         # passages in the prompt, by number
    hits: list[SearchHit]            # everything the search returned, by rank
    trimmed: TrimResult              # with no collection: no chunks, the question's own tokens

    def cited(self, answer: str) -> list[int]:
        """The passage numbers the answer cites ([n], as the prompt asks). Small models often
        quote a passage without citing it: then the one passage holding the most of the answer's
        words, if at least half, so the answer still points at where it came from."""
        cited = sorted({int(n) for n in CITE.findall(answer)} & {p.number for p in self.citations})
        said = set(words(answer))
        if cited or not said:
            return cited
        share = {p.number: len(said & set(words(p.hit.chunk.text))) / len(said) for p in self.citations}
        best = max(sorted(share), key=share.get, default=None)
        return [best] if best is not None and share[best] >= 0.5 else []


def rag_context(collection, question: str, budget: int, tokenizer: TokenCounter, k: int,
                messages: list[dict[str, str]] | None = None, vector=None, lead: Sequence[Chunk] = (),
                hits: list[SearchHit] | None = None, selector: Selector | None = None) -> RagContext:
    """`collection`: a retrieval Collection, or None to send the question (or `messages`) alone.
    `question` is what is searched for; the budget counts the whole conversation when
    `messages` is given; `vector` is the question's embedding when the caller has it already
    (the gateway's router embeds the question once for both); `lead`: the passages of an
    earlier, narrower call that this one widens, kept and put first (trim); `hits`: that
    question's search results when the caller has them (one search, trimmed to several budgets);
    `selector`: cut the hits down to their sentences that bear on the question before trimming
    (select.py), None for whole chunks. Raises RetrievalError (OverBudget when nothing could be dropped)."""
    text = question if messages is None else "\n".join(m["content"] for m in messages)
    if collection is None:
        tokens = len(tokenizer.encode(text))
        if tokens > budget:
            raise OverBudget(tokens, budget, "question" if messages is None else "conversation")
        return RagContext(messages or [{"role": "user", "content": question}], [], [],
                          TrimResult([], [], tokens, budget))
    hits = collection.search(question, k=k, vector=vector) if hits is None else hits
    chunks = ([h.chunk for h in hits] if selector is None
              else selector.select(question, hits, budget, tokenizer, lead, counted=text))
    result = trim(chunks, text, budget, tokenizer, lead=lead)
    prompt = build_prompt(question, result.chunks, lead=lead)
    if messages is None:
        composed = prompt.messages
    else:   # passages first, so the prefix is shared; then the client's own system message
        system, rest = prompt.messages[0]["content"], messages
        if rest[0]["role"] == "system":
            system, rest = f"{system}\n\n{rest[0]['content']}", rest[1:]
        composed = [{"role": "system", "content": system}, *rest]
    by_id = {h.chunk.id: h for h in hits}
    citations = [Passage(int(n), by_id[cid]) for n, cid in prompt.citations.items()]
    return RagContext(composed, citations, hits, result)
