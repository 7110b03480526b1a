"""Passage selection: the sentences of the best hits that bear on the question, so that a small
context budget holds the answer rather than the first whole chunks that fit.

The hits' chunks are cut into sentences (at the chunker's sentence ends) and those into clauses
(at , ; and : before a space). Each sentence is scored by BM25 of the question's words over the
sentences, plus its hit's search score (the chunk holding the answer is usually ranked first)
and a share of its better neighbour's score (an answer sentence often names its subject only in
the one before). Clauses are taken by their sentence's score, and within a sentence by how many
of the question's words they hold, each chunk priced as trim prices a passage, until the budget
is full: a sentence that does not fit may still give the clause that matters.

A chunk keeps its chosen pieces in document order (neighbours as the document wrote them, gaps
shown as " … ") and its doc_id and position, so its id and citation still point at its
document. trim then fits these chunks with its exact count. The lead's chunks pass unchanged.

Scored by MiniLM cosine instead, alone or added to BM25, the answer was in the context no more
often on SQuAD, for 30 times the time on 2 cores; so the scoring is lexical.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .documents import _PARAGRAPH, _SENTENCE_END
from .prompt import passage, system_text
from .types import Chunk, RetrievalError, SearchHit, TokenCounter

GAP = " … "
GRAINS = ("sentence", "clause")
PRIOR = 4.0  # weight of the hit's search score (in [0, 1] for hybrid) against z-scored BM25
NEIGHBOUR = 0.3
K1, B = 1.2, 0.75
_CLAUSE_END = re.compile(r"[,;:](?=\s)")


@dataclass(frozen=True)
class Piece:
    chunk: int  # index among the chunks selected from
    sentence: int  # index among all their sentences
    start: int  # character span in the chunk's text
    end: int


@dataclass(frozen=True)
class Selector:
    top: int = 10  # hits read
    grain: str = "clause"  # the smallest piece taken: "clause", or "sentence" to keep sentences whole

    def __post_init__(self):
        if self.grain not in GRAINS:
            raise RetrievalError(f"unknown selection grain {self.grain!r}: use {' or '.join(GRAINS)}")

    def select(self, question: str, hits: Sequence[SearchHit], budget: int, tokenizer: TokenCounter,
               lead: Sequence[Chunk] = (), counted: str | None = None) -> list[Chunk]:
        """For trim: the lead's chunks that are among the hits, as they are, then the best hits'
        chunks cut down to their best pieces, best first, as many as `budget` tokens hold.
        `counted`: the text the budget counts beside the passages when it is more than the
        question (a conversation)."""
        count = lambda text: len(tokenizer.encode(text))
        first = {c.id: c for c in lead}
        kept = [first[h.chunk.id] for h in hits if h.chunk.id in first]
        chosen_from = [h for h in hits[:self.top] if h.chunk.id not in first]
        chunks = [h.chunk for h in chosen_from]
        sentences = _sentences(chunks, kept)
        if not sentences:
            return kept
        texts = [chunks[i].text[a:b] for i, a, b in sentences]
        scores = _standard(_bm25(words(question), [words(t) for t in texts]))
        scores += PRIOR * np.array([chosen_from[i].score for i, _, _ in sentences], np.float32)
        scores += NEIGHBOUR * _better_neighbour([i for i, _, _ in sentences], scores)
        pieces, order = self._pieces(question, sentences, chunks, scores)

        widest = len(kept) + len(chunks)  # the number trim prices a passage with
        used = count(system_text(kept, lead=kept)) + count(counted or question)
        own = [count(chunks[p.chunk].text[p.start:p.end]) for p in pieces]
        picked: dict[int, list[Piece]] = {}  # by chunk, in the order chunks were first picked
        price: dict[int, int] = {}
        for n in order:
            p = pieces[n]
            # A piece adds about its own tokens (a join may merge one or two): skip what cannot fit unpriced.
            if own[n] > budget - used + 2:
                continue
            trial = sorted([*picked.get(p.chunk, []), p], key=lambda x: x.start)
            cost = count("\n\n" + passage(widest, _cut(chunks[p.chunk], trial)))
            if used + cost - price.get(p.chunk, 0) <= budget:
                used += cost - price.get(p.chunk, 0)
                picked[p.chunk], price[p.chunk] = trial, cost
        return [*kept, *(_cut(chunks[i], ps) for i, ps in picked.items())]

    def _pieces(self, question: str, sentences: list[tuple[int, int, int]], chunks: list[Chunk],
                scores: np.ndarray) -> tuple[list[Piece], list[int]]:
        """The pieces to take, and the order to try them in: by their sentence's score, then by
        the question's words they hold (the share of their sentence's, so it only breaks ties)."""
        pieces = [Piece(i, s, a, b) for s, (i, a, b) in enumerate(sentences)]
        if self.grain == "clause":
            pieces = [Piece(p.chunk, p.sentence, a, b) for p in pieces for a, b in _clauses(chunks[p.chunk].text, p)]
        asked = set(words(question))
        held = np.array([len(asked & set(words(chunks[p.chunk].text[p.start:p.end]))) for p in pieces], np.float32)
        of = np.array([p.sentence for p in pieces])
        most = np.zeros(len(sentences), np.float32)
        np.maximum.at(most, of, held)
        keys = scores[of] + 1e-3 * held / np.maximum(most[of], 1)
        return pieces, list(np.argsort(-keys, kind="stable"))


def _sentences(chunks: list[Chunk], lead: Sequence[Chunk]) -> list[tuple[int, int, int]]:
    """(chunk index, start, end) of each sentence, once: neighbouring chunks of a document share
    sentences, and the lead may hold some already."""
    seen = {" ".join(c.text[a:b].split()) for c in lead for a, b in _spans(c.text)}
    out = []
    for i, c in enumerate(chunks):
        for a, b in _spans(c.text):
            key = " ".join(c.text[a:b].split())
            if key not in seen:
                seen.add(key)
                out.append((i, a, b))
    return out


def _spans(text: str) -> list[tuple[int, int]]:
    spans = []
    for para in _PARAGRAPH.finditer(text):
        a, b = para.span()
        for end in [m.end() for m in _SENTENCE_END.finditer(text, a, b)] + [b]:
            spans.append((a, end))
            a = end + len(text[end:b]) - len(text[end:b].lstrip())
    return spans


def _clauses(text: str, p: Piece) -> list[tuple[int, int]]:
    ends = [m.end() for m in _CLAUSE_END.finditer(text, p.start, p.end)] + [p.end]
    starts = [p.start] + [e + len(text[e:p.end]) - len(text[e:p.end].lstrip()) for e in ends[:-1]]
    return list(zip(starts, ends))


def _cut(chunk: Chunk, pieces: list[Piece]) -> Chunk:
    """The chunk with only these pieces (in document order): runs of neighbours as written, gaps between runs."""
    runs, text = [], chunk.text
    for p in pieces:
        if runs and not text[runs[-1][1]:p.start].strip():
            runs[-1][1] = p.end
        else:
            runs.append([p.start, p.end])
    return replace(chunk, text=GAP.join(text[a:b] for a, b in runs))


def words(text: str) -> list[str]:
    """Lower-cased words, plural and tense endings cut so that "sacks" meets "sack" and "passed" "pass"."""
    return [re.sub(r"(?<=\w{3})(ing|ed|es|s)$", "", w) if len(w) > 4 else w for w in re.findall(r"\w+", text.lower())]


def _bm25(question: list[str], sentences: list[list[str]]) -> np.ndarray:
    """BM25 of the question's words, the sentences being the corpus (their IDF too: words that
    all the hits share, their topic, tell the sentences apart least)."""
    bags = [Counter(s) for s in sentences]
    lengths = np.array([len(s) for s in sentences], np.float32)
    norm = K1 * (1 - B + B * lengths / max(1.0, float(lengths.mean())))
    scores = np.zeros(len(sentences), np.float32)
    for w in set(question):
        tf = np.array([bag[w] for bag in bags], np.float32)
        df = int((tf > 0).sum())
        if df:
            scores += math.log(1 + (len(sentences) - df + 0.5) / (df + 0.5)) * tf * (K1 + 1) / (tf + norm)
    return scores


def _better_neighbour(chunk_of: list[int], scores: np.ndarray) -> np.ndarray:
    """For each sentence, the higher score of the sentences just before and after it in its chunk."""
    best = np.zeros_like(scores)
    for n in range(len(scores) - 1):
        if chunk_of[n] == chunk_of[n + 1]:
            best[n] = max(best[n], scores[n + 1])
            best[n + 1] = max(best[n + 1], scores[n])
    return best


def _standard(x: np.ndarray) -> np.ndarray:
    """z-scores, so the prior weighs the same against the BM25 of any question; all equal: zeros."""
    return (x - x.mean()) / x.std() if x.std() > 0 else np.zeros_like(x)
