"""Types shared by every retrieval step, and the one error they raise."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import tokenizers


class RetrievalError(ValueError):
    """Bad input to retrieval: the message names what was wrong."""


class TokenCounter(Protocol):
    """All retrieval needs from a tokenizer: the engine's tokenizer satisfies it as is."""

    def encode(self, text: str) -> list[int]: ...


class HFTokenizer:
    """Adapts a Hugging Face `tokenizers.Tokenizer` (a model's tokenizer.json) to `TokenCounter`."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        # Some tokenizer.json files (all-MiniLM's among them) pad and truncate to 128 tokens,
        # which would make every count wrong; counting wants neither.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.hf = tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids


@dataclass(frozen=True)
class Span:
    """Where the text from `start` on came from, until the next span: a page of a PDF (from 1),
    or the path of headings it sits under ("Install > Linux") in Markdown, HTML and Word."""
    start: int
    page: int | None = None
    section: str = ""


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    spans: tuple[Span, ...] = ()
    # What re-ingest compares: the file's bytes when read from one (so an unchanged file is not
    # even read again), else the text and all that goes with it. Empty: worked out on ingest.
    digest: str = ""


@dataclass(frozen=True)
class Chunk:
    doc_id: str
    position: int  # index of the chunk within its document, from 0
    text: str
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    page: int | None = None  # the page it starts on (PDF), for citations
    page_end: int | None = None  # the page it ends on
    section: str = ""  # the headings it sits under (Markdown, HTML, Word)

    @property
    def id(self) -> str:
        # Stable across re-ingests: the same document cut the same way gives the same ids.
        return f"{self.doc_id}#{self.position}"


@dataclass(frozen=True)
class SearchHit:
    chunk: Chunk
    score: float  # higher is better: cosine (dense), BM25 (bm25) or fused in [0, 1] (hybrid)
