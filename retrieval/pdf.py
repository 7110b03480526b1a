"""The text of a PDF, page by page, in the order a person reads it.

pdfminer.six (MIT) does the layout analysis: characters into lines, lines into text boxes,
boxes into reading order (a two-column page reads down the left column, then the right).
On top of it:

- a running header or footer is dropped: a line among the two nearest the top or the bottom
  edge of at least three pages (every page of a shorter document), compared with its digits
  masked, so "Chapter 2 ... 17" on one page and "Chapter 2 ... 18" on the next are one line;
  a bare page number at an edge goes too;
- a word hyphenated across a line break is joined: "infor-" + "mation" becomes "information",
  unless the document spells the pair with a hyphen elsewhere ("well-known");
- ligatures and other compatibility characters are normalized (NFKC), so "ﬁle" matches "file".

A PDF with no text layer (a scan) is refused: there is no OCR. So is an encrypted one that
needs a password, and one pdfminer cannot parse; the reason says which.
"""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from io import BytesIO

from .types import Span

EDGE_LINES = 2          # lines nearest each edge that may be a running header or footer
RUNNING_PAGES = 3       # ...when the same line is there on this many pages (and a quarter of them)
GUTTER = 9.0            # points of white between two columns (a bullet sits closer to its text)
_CID = re.compile(r"\(cid:\d+\)")          # a glyph with no Unicode mapping
_PAGE_NUMBER = re.compile(r"(?:page\s*)?#(?:\s*(?:of|/)\s*#)?|[-–—]\s*#\s*[-–—]"
                          r"|(?=[ivxlcdm])m{0,3}(?:cm|cd|d?c{0,3})(?:xc|xl|l?x{0,3})(?:ix|iv|v?i{0,3})")
_WORD = re.compile(r"[^\W\d_]+(?:-[^\W\d_]+)*")
_HYPHENATED_END = re.compile(r"([^\W\d_]+)-$")
_LOWER_START = re.compile(r"([^\W\d_A-Z][^\W\d_]*)")


class PDFError(Exception):
    """The PDF cannot be read; the message says why, for a person."""


@dataclass
class _Line:
    text: str
    top: float          # distance from the top edge to the line's top, in points
    bottom: float       # distance from the bottom edge to the line's bottom
    height: float
    box: int            # the text box it belongs to, in reading order


def extract(data: bytes) -> tuple[str, list[Span], str]:
    """(text, one span per page that has text, title from the PDF's metadata)."""
    pages, title = _pages(data)
    if not any(line.text.strip() for page in pages for line in page):
        raise PDFError(f"no text layer on any of its {len(pages)} page(s) (a scan?); "
                       f"Sluice does not do OCR: run one first (e.g. ocrmypdf) and upload its output")
    running, bands = _running(pages), _bands(pages)
    vocabulary = {w.lower() for page in pages for line in page for w in _WORD.findall(line.text)}
    # A text box is a paragraph; its lines stay lines, except where a word was hyphenated
    # across them (within a box, or across a column or page break).
    text, spans, where = "", [], None
    for number, page in enumerate(pages, 1):
        edges = _edges(page)
        for i, line in enumerate(page):
            if i in edges and _is_running(line, running, bands):
                continue
            # A box that goes on with a sentence the one before left open is the same paragraph.
            same = (number, line.box) == where or (where and where[0] == number and _continues(text, line.text))
            piece, sep = line.text, "" if not text else "\n" if same else "\n\n"
            if text and _joins(text, piece):
                text, piece = _join(text, piece, vocabulary)
                sep = ""
            if not spans or spans[-1].page != number:
                spans.append(Span(len(text) + len(sep), page=number))
            text += sep + piece
            where = (number, line.box)
    # A page whose only text finished a word of the page before starts no span of its own.
    spans = [s for s, nxt in zip(spans, [*spans[1:], None]) if s.start < (nxt.start if nxt else len(text))]
    return text, spans, title


def _pages(data: bytes) -> tuple[list[list[_Line]], str]:
    from pdfminer.converter import PDFPageAggregator
    from pdfminer.layout import LAParams, LTTextContainer, LTTextLine
    from pdfminer.pdfdocument import PDFDocument, PDFPasswordIncorrect
    from pdfminer.pdfinterp import PDFPageInterpreter, PDFResourceManager
    from pdfminer.pdfpage import PDFPage
    from pdfminer.pdfparser import PDFParser
    try:
        document = PDFDocument(PDFParser(BytesIO(data)), password="")
    except PDFPasswordIncorrect:
        raise PDFError("encrypted: it needs a password to open; upload a copy without one") from None
    except Exception as e:         # pdfminer raises many kinds on a damaged file; none may escape as a 500
        raise PDFError(f"not a readable PDF ({_why(e)})") from None
    resources = PDFResourceManager(caching=True)
    device = PDFPageAggregator(resources, laparams=LAParams())
    interpreter = PDFPageInterpreter(resources, device)
    pages = []
    try:
        for page in PDFPage.create_pages(document):
            interpreter.process_page(page)
            layout = device.get_result()
            lines = []
            boxes = [e for e in layout if isinstance(e, LTTextContainer)]
            order = _reading_order([(b.x0, layout.y1 - b.y1, b.x1, layout.y1 - b.y0) for b in boxes])
            for b, box in enumerate(boxes[i] for i in order):
                for line in box:
                    if isinstance(line, LTTextLine):
                        text = unicodedata.normalize("NFKC", _CID.sub("", line.get_text())).strip()
                        if text:
                            lines.append(_Line(text, layout.y1 - line.y1, line.y0 - layout.y0, line.height, b))
            pages.append(lines)
    except Exception as e:
        raise PDFError(f"page {len(pages) + 1} cannot be read ({_why(e)})") from None
    if not pages:
        raise PDFError("not a readable PDF (it has no pages)")
    return pages, _title(document)


def _reading_order(boxes: list[tuple[float, float, float, float]]) -> list[int]:
    """Text boxes (x0, top, x1, bottom, in points from the top left) in reading order, by XY-cut:
    a region splits first into columns, at a gutter no box crosses from its top to its bottom,
    else into two at its widest horizontal gap, and each part is read in turn. So a two-column
    page reads down the left column and then the right, and a full-width block below them
    after both."""
    def cut(ids: list[int]) -> list[int]:
        if len(ids) < 2:
            return ids
        xs = sorted(ids, key=lambda i: boxes[i][0])
        reach = boxes[xs[0]][2]
        for k in range(1, len(xs)):
            if boxes[xs[k]][0] - reach >= GUTTER:
                return cut(xs[:k]) + cut(xs[k:])
            reach = max(reach, boxes[xs[k]][2])
        ys = sorted(ids, key=lambda i: boxes[i][1])
        widest, at, reach = 0.0, None, boxes[ys[0]][3]
        for k in range(1, len(ys)):
            if boxes[ys[k]][1] - reach > widest:
                widest, at = boxes[ys[k]][1] - reach, k
            reach = max(reach, boxes[ys[k]][3])
        if at is None:               # overlapping boxes all the way down: top to bottom, left to right
            return sorted(ids, key=lambda i: (round(boxes[i][1]), boxes[i][0]))
        return cut(ys[:at]) + cut(ys[at:])
    return cut(list(range(len(boxes))))


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _title(document) -> str:
    for info in document.info:
        title = info.get("Title")
        title = getattr(title, "resolve", lambda: title)() if title is not None else None
        if isinstance(title, bytes):
            from pdfminer.utils import decode_text
            title = decode_text(title)
        if isinstance(title, str) and title.strip():
            return " ".join(title.split())
    return ""


# ---- running headers and footers ----

def _key(text: str) -> str:
    return re.sub(r"\d+", "#", " ".join(text.lower().split()))


def _edges(page: list[_Line]) -> set[int]:
    """Indexes of the lines nearest the top and the bottom of a page."""
    by_top = sorted(range(len(page)), key=lambda i: page[i].top)
    by_bottom = sorted(range(len(page)), key=lambda i: page[i].bottom)
    return set(by_top[:EDGE_LINES]) | set(by_bottom[:EDGE_LINES])


def _running(pages: list[list[_Line]]) -> set[str]:
    """Keys of lines found at an edge of enough pages to be running heads or feet."""
    counts = Counter(k for page in pages for k in {_key(page[i].text) for i in _edges(page)})
    enough = min(max(RUNNING_PAGES, len(pages) // 4), len(pages)) if len(pages) > 1 else 2
    return {k for k, n in counts.items() if n >= enough}


def _bands(pages: list[list[_Line]]) -> tuple[set[int], set[int]]:
    """Positions (points from the top, from the bottom) where half the pages or more have a line
    standing apart from the rest: the header and footer bands. Whatever sits there is a running
    head or foot even when its text changes with each chapter, as a book's headers do."""
    tops, bottoms = Counter(), Counter()
    for page in pages:
        for edge, counts in (("top", tops), ("bottom", bottoms)):
            rows = sorted(page, key=lambda line: getattr(line, edge))
            if len(rows) < 2:
                continue
            first = rows[0]
            nxt = next((r for r in rows if getattr(r, edge) > getattr(first, edge) + first.height / 2), None)
            if nxt is not None and getattr(nxt, edge) - getattr(first, edge) - first.height > 1.5 * first.height:
                counts[round(getattr(first, edge) / 2)] += 1
    enough = max(2, len(pages) / 2)
    return ({k for k, n in tops.items() if n >= enough}, {k for k, n in bottoms.items() if n >= enough})


def _is_running(line: _Line, running: set[str], bands: tuple[set[int], set[int]]) -> bool:
    key = _key(line.text)
    in_band = any(round(getattr(line, edge) / 2) + d in band for edge, band in zip(("top", "bottom"), bands)
                  for d in (-1, 0, 1))
    return in_band or key in running or bool(_PAGE_NUMBER.fullmatch(key))


# ---- words hyphenated across lines ----

def _continues(before: str, after: str) -> bool:
    return not before.rstrip().endswith((".", ":", ";", "!", "?")) and bool(_LOWER_START.match(after))


def _joins(before: str, after: str) -> bool:
    return bool(_HYPHENATED_END.search(before) and _LOWER_START.match(after.lstrip()))


def _join(before: str, after: str, vocabulary: set[str]) -> tuple[str, str]:
    """`before` ends "infor-", `after` starts "mation, ...": ("...information", ", ...")."""
    head = _HYPHENATED_END.search(before).group(1)
    after = after.lstrip()
    tail = _LOWER_START.match(after).group(1)
    keep = f"{head}-{tail}".lower() in vocabulary and (head + tail).lower() not in vocabulary
    return before[:-1] + ("-" if keep else "") + tail, after[len(tail):]

