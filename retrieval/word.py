"""A Word (.docx) file as Markdown, read with python-docx (MIT): headings become `#` lines (so
chunks know the heading path they sit under, as in Markdown), list paragraphs `- ` items,
tables rows of cells between `|`; paragraphs and tables in document order.

A .docx is a ZIP archive, and python-docx reads every part of it into memory, so the archive
is checked before it is opened: its parts may unpack to at most MAX_UNPACKED bytes and at
most MAX_RATIO times their packed size (a ZIP bomb unpacks to thousands of times its size;
Word's XML packs about 10x).
"""
from __future__ import annotations

import re
import zipfile
from io import BytesIO

MAX_UNPACKED = 256 * 2**20
MAX_RATIO = 200
MAX_PARTS = 10_000
_HEADING = re.compile(r"(?:Heading|heading)\s*(\d)")


class WordError(Exception):
    """The file cannot be read as a Word document; the message says why, for a person."""


def check_archive(data: bytes) -> zipfile.ZipFile:
    """The ZIP archive in `data`, once its declared sizes are safe to unpack. (zipfile never
    unpacks a part past its declared size, so the declared sizes bound the memory.)"""
    try:
        archive = zipfile.ZipFile(BytesIO(data))
    except (zipfile.BadZipFile, ValueError) as e:
        raise WordError(f"not a readable Word file (a damaged ZIP archive: {e})") from None
    parts = archive.infolist()
    unpacked = sum(p.file_size for p in parts)
    packed = max(1, sum(p.compress_size for p in parts))
    if len(parts) > MAX_PARTS or unpacked > MAX_UNPACKED or unpacked > MAX_RATIO * packed:
        raise WordError(f"refused as a ZIP bomb: its {len(parts)} parts would unpack to {unpacked:,} bytes from "
                        f"{packed:,} ({unpacked / packed:.0f}x; a Word file may unpack to {MAX_UNPACKED:,} bytes "
                        f"and {MAX_RATIO}x)")
    if "word/document.xml" not in archive.namelist():
        raise WordError("a ZIP archive without word/document.xml: not a Word document")
    return archive


def markdown(data: bytes) -> tuple[str, str]:
    """(the document as Markdown, its title: the core properties' title or the first heading)."""
    check_archive(data)
    import docx
    from docx.table import Table
    try:
        document = docx.Document(BytesIO(data))
        blocks, first_heading = [], ""
        for block in document.iter_inner_content():
            if isinstance(block, Table):
                blocks.append(_table(block))
                continue
            text = " ".join(block.text.split())
            if not text:
                continue
            style = block.style.name if block.style is not None else ""
            level = 1 if style == "Title" else int(m.group(1)) if (m := _HEADING.match(style)) else 0
            if level:
                first_heading = first_heading or text
                blocks.append(f"{'#' * level} {text}")
            elif style.startswith("List"):
                blocks.append(f"- {text}")
            else:
                blocks.append(text)
        title = (document.core_properties.title or "").strip() or first_heading
    except WordError:
        raise
    except Exception as e:        # python-docx and lxml raise many kinds on a damaged file
        raise WordError(f"not a readable Word file ({type(e).__name__}: {e})") from None
    # Consecutive list items stay one block, so the chunker sees a list.
    text = "\n\n".join(blocks)
    return re.sub(r"(^- .*)\n\n(?=- )", r"\1\n", text, flags=re.M), title


def _table(table) -> str:
    rows = []
    for row in table.rows:
        cells = [" ".join(c.text.split()) for c in row.cells]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
