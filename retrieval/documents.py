"""Parse documents (plain text, Markdown, HTML, JSONL) and cut them into token-bounded chunks.
(Files, PDF and Word among them, are read in files.py; their text comes here.)

Chunks are cut at sentence ends, preferably at paragraph ends, and never hold more than
`size` tokens of the tokenizer they were cut with. Neighbouring chunks of one paragraph
share up to `overlap` tokens of whole sentences, so a fact that straddles a cut is still
whole in one of them. Each chunk keeps where it came from (page, heading path) for citations.
"""
from __future__ import annotations

import bisect
import functools
import json
import re
from dataclasses import dataclass

from .types import Chunk, Document, RetrievalError, Span, TokenCounter

FORMATS = ("text", "markdown", "html", "jsonl")


def parse(content: str, kind: str, doc_id: str | None = None, title: str = "",
          metadata: dict | None = None) -> list[Document]:
    """Documents from raw content; JSONL carries its own ids, other kinds need `doc_id`."""
    if kind == "jsonl":
        return _parse_jsonl(content)
    if kind not in FORMATS:
        raise RetrievalError(f"unsupported document type {kind!r}: use text, markdown, html or jsonl")
    if not doc_id:
        raise RetrievalError(f"a {kind} document needs a document id")
    content = content.replace("\r\n", "\n")
    if kind == "html":
        content, html_title = _html_text(content)
        title = title or html_title
    if kind in ("markdown", "html"):       # the extractor writes HTML's main content as Markdown
        content, md_title = _markdown(content)
        return [document(doc_id, content, title or md_title, metadata or {}, sections=True)]
    return [document(doc_id, content, title, metadata or {})]


def document(doc_id, text, title, metadata, spans: list[Span] | tuple = (), sections: bool = False,
             digest: str = "") -> Document:
    """A checked Document; `sections`: its spans are the Markdown heading paths of `text`."""
    if not isinstance(doc_id, str) or not doc_id.strip():
        raise RetrievalError(f"document id must be a non-empty string, got {doc_id!r}")
    if not isinstance(text, str) or not text.strip():
        raise RetrievalError(f"document {doc_id!r} is empty")
    if not isinstance(title, str):
        raise RetrievalError(f"title of document {doc_id!r} must be a string, got {title!r}")
    if not isinstance(metadata, dict):
        raise RetrievalError(f"metadata of document {doc_id!r} must be an object, got {metadata!r}")
    lead = len(text) - len(text.lstrip())
    text = text.strip()
    spans = _sections(text) if sections else tuple(
        Span(max(0, s.start - lead), s.page, s.section) for s in spans if s.start - lead < len(text))
    return Document(doc_id, text, title.strip(), metadata, spans, digest)


def _parse_jsonl(content: str) -> list[Document]:
    docs, seen = [], set()
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RetrievalError(f"JSONL line {n} is not JSON: {e}") from None
        if not isinstance(row, dict):
            raise RetrievalError(f"JSONL line {n} must be an object with id, text, title, metadata")
        missing = {"id", "text"} - row.keys()
        extra = row.keys() - {"id", "text", "title", "metadata"}
        if missing or extra:
            raise RetrievalError(f"JSONL line {n}: " + "; ".join(
                [f"missing {', '.join(sorted(missing))}"] * bool(missing)
                + [f"unexpected {', '.join(sorted(extra))} (put extra fields under metadata)"] * bool(extra)))
        if row["id"] in seen:
            raise RetrievalError(f"JSONL line {n}: document id {row['id']!r} appears twice")
        seen.add(row["id"])
        docs.append(document(row["id"], row["text"], row.get("title", ""), row.get("metadata", {})))
    if not docs:
        raise RetrievalError("JSONL content holds no documents")
    return docs


_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
_FENCE = re.compile(r"^(```|~~~)", re.M)


def _markdown(text: str) -> tuple[str, str]:
    """Markdown stays Markdown (models read it well); headings are made to start paragraphs."""
    first = _HEADING.search(text)
    text = re.sub(r"\n{3,}", "\n\n", _HEADING.sub(lambda m: f"\n{m.group(0)}\n", text))
    return text, (first.group(2) if first else "")


def _sections(text: str) -> tuple[Span, ...]:
    """A span at each Markdown heading, naming the path of headings it opens ("Install > Linux").
    A `#` line inside a fenced code block is code, not a heading."""
    fences = [m.start() for m in _FENCE.finditer(text)]
    spans, path = [], []
    for m in _HEADING.finditer(text):
        if bisect.bisect(fences, m.start()) % 2:
            continue
        level = len(m.group(1))
        path = [p for p in path if p[0] < level] + [(level, " ".join(m.group(2).split()))]
        spans.append(Span(m.start(), section=" > ".join(t for _, t in path)))
    return tuple(spans)


def _html_text(html: str) -> tuple[str, str]:
    """(the page's main content as Markdown, its <title>). trafilatura (Apache-2.0) finds the
    main content, so navigation, footers and cookie banners stay out. A fragment with no page
    around it is all content: it is read as an article (trafilatura drops headings, and may drop
    short text, outside a container), and where nothing is found all visible text is kept."""
    import lxml.html
    import trafilatura
    if not _PAGE.search(html):
        html = f"<html><body><article>{html}</article></body></html>"
    found = trafilatura.bare_extraction(html, output_format="python", include_formatting=True,
                                        include_tables=True, include_links=False, include_images=False,
                                        include_comments=False, favor_recall=True, config=_trafilatura_config())
    text = found.text if found is not None and found.text else ""
    if not text.strip():
        text = trafilatura.html2txt(html, clean=True) or ""
    try:
        title = lxml.html.fromstring(html.encode()).findtext(".//title") or ""
    except Exception:            # lxml refuses some fragments outright; the text is what matters
        title = ""
    return text, " ".join(title.split())


_PAGE = re.compile(r"<(?:html|body)\b", re.I)


@functools.cache
def _trafilatura_config():
    from trafilatura.settings import use_config
    config = use_config()
    config.set("DEFAULT", "EXTRACTION_TIMEOUT", "0")     # its timeout uses SIGALRM: main thread only
    config.set("DEFAULT", "MIN_EXTRACTED_SIZE", "0")     # a short page is still a page
    return config


# ---- chunking ----

_PARAGRAPH = re.compile(r"\S(?:.*?\S)?(?=\s*\n[ \t]*\n|\s*$)", re.S)
# A sentence ends at . ! or ? (and any closing quotes or brackets) before whitespace and a
# capital, digit, quote or bracket. Abbreviations split too often; that only adds cut points.
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*(?=\s+[\"'“‘(\[A-Z0-9])")
# A line that starts a list item: "- ", "* ", "+ ", "1. ", "2) ". The match starts at its newline.
_LIST_ITEM = re.compile(r"\n[ \t]*(?:[-*+]|\d{1,3}[.)])[ \t]+")


@dataclass
class _Unit:
    start: int  # character span in the document text
    end: int
    tokens: int
    ends_paragraph: bool


def chunk(doc: Document, tokenizer: TokenCounter, size: int = 200, overlap: int = 32) -> list[Chunk]:
    """Cut a document into chunks of at most `size` tokens, each knowing its page or headings."""
    # 8 tokens hold any single character, even one that a byte-level BPE spells in 4 bytes.
    if size < 8 or not 0 <= overlap < size:
        raise RetrievalError(f"chunk size must be at least 8 and overlap in [0, size), got size={size}, "
                             f"overlap={overlap}")
    text = doc.text
    count = lambda a, b: len(tokenizer.encode(text[a:b]))
    units = _units(text, count, size)
    # A heading starts a chunk, so a chunk's heading path holds for all of it (pages do not cut).
    sections = {s.start for s in doc.spans if s.page is None}
    chunks, start = [], 0
    while start < len(units):
        end, total = start + 1, units[start].tokens
        while end < len(units) and total + units[end].tokens <= size and units[end].start not in sections:
            total += units[end].tokens
            end += 1
        if end < len(units) and units[end].start not in sections:
            # Prefer ending at a paragraph when that keeps the chunk at least half full.
            for j in range(end - 1, start, -1):
                if units[j].ends_paragraph and sum(u.tokens for u in units[start:j + 1]) >= size // 2:
                    end = j + 1
                    break
        # Unit counts add up only approximately for subword tokenizers: check the real span.
        while end > start + 1 and count(units[start].start, units[end - 1].end) > size:
            end -= 1
        a, b = units[start].start, units[end - 1].end
        chunks.append(Chunk(doc.id, len(chunks), text[a:b], doc.title, doc.metadata, **_where(doc, a, b)))
        if end == len(units):
            break
        # Overlap: step back over whole sentences of the same paragraph, at most `overlap`
        # tokens and leaving room for the next new sentence.
        limit, nxt = min(overlap, size - units[end].tokens), end
        while (nxt - 1 > start and not units[nxt - 1].ends_paragraph
               and count(units[nxt - 1].start, units[end - 1].end) <= limit):
            nxt -= 1
        start = nxt
    return chunks


def _where(doc: Document, a: int, b: int) -> dict:
    """The page (first and last) and heading path of text[a:b], from the document's spans."""
    starts = [s.start for s in doc.spans]
    first, last = bisect.bisect_right(starts, a) - 1, bisect.bisect_left(starts, b) - 1
    if first < 0:               # before the first heading
        return {}
    span = doc.spans[first]
    if span.page is not None:
        return {"page": span.page, "page_end": doc.spans[last].page}
    return {"section": span.section}


def _units(text: str, count, size: int) -> list[_Unit]:
    """Sentences (or, when a sentence is too long, pieces of it) with their token counts. A list
    item ends a paragraph too: a bullet is a unit of meaning, and a chunk cut inside one starts
    with the tail of the bullet before, which a model reads as part of the next."""
    units = []
    for para in _PARAGRAPH.finditer(text):
        a, b = para.span()
        items = {m.start() for m in _LIST_ITEM.finditer(text, a, b)}
        # One marker alone is prose that wrapped at a number ("\n4) was discovered"), not a list.
        items = items if len(items) > 1 else set()
        for c in sorted({m.end() for m in _SENTENCE_END.finditer(text, a, b)} | items | {b}):
            if c > a:
                units += [_Unit(x, y, count(x, y), False) for x, y in _fit(text, a, c, count, size)]
            if c in items or c == b:
                units[-1].ends_paragraph = True
            a = _skip_space(text, c, b)
    return units


def _fit(text: str, a: int, b: int, count, size: int) -> list[tuple[int, int]]:
    """Split text[a:b] into spans of at most `size` tokens: at spaces, or inside an overlong word."""
    spans = []
    while count(a, b) > size:
        end = _longest([a + m.start() for m in re.finditer(r"\s+", text[a:b]) if m.start()], a, count, size)
        end = end or _longest(range(a + 1, b), a, count, size)
        spans.append((a, end))
        a = _skip_space(text, end, b)
    return spans + [(a, b)]


def _longest(ends, a: int, count, size: int) -> int | None:
    """The last of the sorted `ends` for which text[a:end] fits in `size` tokens (binary search)."""
    if not ends or count(a, ends[0]) > size:
        return None
    lo, hi = 0, len(ends) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(a, ends[mid]) <= size else (lo, mid - 1)
    return ends[lo]


def _skip_space(text: str, i: int, b: int) -> int:
    while i < b and text[i].isspace():
        i += 1
    return i
