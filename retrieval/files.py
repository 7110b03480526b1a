"""Files as people have them: plain text, Markdown, HTML, JSONL, PDF and Word, the type taken
from the content first and the name second; the document id is the file's name.

Every refusal is a `BadFile` naming the file and the reason, with a code the gateway turns
into a status: `empty` and `unreadable` (422), `too_large` (413), `unsupported_type` (415).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Callable

from . import pdf, word
from .documents import document, parse
from .types import Document, RetrievalError

KINDS = {".txt": "text", ".text": "text", ".md": "markdown", ".markdown": "markdown", ".html": "html",
         ".htm": "html", ".jsonl": "jsonl", ".pdf": "pdf", ".docx": "docx"}
# Part of every file's digest: a change to how files are read makes unchanged files read anew.
READER_VERSION = "1"
_OLE = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"       # Office's old container: .doc, or an encrypted .docx


class BadFile(RetrievalError):
    def __init__(self, name: str, reason: str, code: str = "unreadable"):
        super().__init__(f"{name}: {reason}")
        self.name, self.reason, self.code = name, reason, code


@dataclass(frozen=True)
class File:
    name: str       # the document id: a file name, or a path relative to the folder ingested
    data: bytes

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(READER_VERSION.encode() + b"\0" + self.data).hexdigest()

    @cached_property
    def kind(self) -> str:
        return kind_of(self.name, self.data)


def kind_of(name: str, data: bytes) -> str:
    """pdf, docx, html, markdown, text or jsonl: what the bytes are, the name deciding among texts."""
    suffix = PurePosixPath(name).suffix.lower()
    named = KINDS.get(suffix)
    if b"%PDF-" in data[:1024]:      # the header may follow a little junk, as readers allow
        return "pdf"
    if data.startswith(b"PK\x03\x04"):
        return "docx"                # or any ZIP: word.check_archive says which
    if data.startswith(_OLE):
        raise BadFile(name, "an Office file in the old binary format, or a Word file encrypted with a password: "
                            "save it as .docx without a password", "unsupported_type")
    if named in ("pdf", "docx"):
        raise BadFile(name, f"named {suffix} but is not a {'PDF' if named == 'pdf' else 'Word (.docx) file'}")
    try:
        head = data[:4096].decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < 4090:           # (a character cut at the 4,096th byte is no evidence)
            raise BadFile(name, f"not a type Sluice reads (not UTF-8 text, PDF or Word; use one of "
                                f"{', '.join(sorted(KINDS))})", "unsupported_type") from None
        head = ""
    if named:
        return named
    if head.lstrip("\ufeff \t\r\n").lower().startswith(("<!doctype html", "<html")):
        return "html"
    if not suffix:
        return "text"
    raise BadFile(name, f"unsupported document type {suffix!r}: use one of {', '.join(sorted(KINDS))}",
                  "unsupported_type")


def check(file: File, max_bytes: int | None = None) -> None:
    """The refusals that need no parsing: an empty file, one over the limit, a type not read."""
    if not file.data:
        raise BadFile(file.name, "the file is empty (0 bytes)", "empty")
    if max_bytes is not None and len(file.data) > max_bytes:
        raise BadFile(file.name, f"{len(file.data):,} bytes is over the limit of {max_bytes:,} bytes a file",
                      "too_large")
    file.kind  # noqa: B018 (raises BadFile for a type that cannot be read)


def read(file: File, max_bytes: int | None = None) -> list[Document]:
    """The documents in a file: one, unless JSONL. Each carries the file's digest (JSONL rows,
    their own), so re-ingesting an unchanged file skips it."""
    check(file, max_bytes)
    try:
        if file.kind == "pdf":
            text, spans, title = pdf.extract(file.data)
            return [document(file.name, text, title, {}, spans, digest=file.digest)]
        if file.kind == "docx":
            text, title = word.markdown(file.data)
            [doc] = parse(text, "markdown", file.name, title)
        else:
            content = _text(file)
            if file.kind == "jsonl":
                return parse(content, "jsonl")
            [doc] = parse(content, file.kind, file.name)
    except (pdf.PDFError, word.WordError) as e:
        raise BadFile(file.name, str(e)) from None
    except BadFile:
        raise
    except RetrievalError as e:
        raise BadFile(file.name, str(e)) from None
    return [Document(doc.id, doc.text, doc.title, doc.metadata, doc.spans, file.digest)]


def read_changed(files: list[File], stored: dict[str, str], max_bytes: int | None = None,
                 progress: Callable[[File], None] | None = None) -> tuple[list[Document], list[str]]:
    """(documents of the files whose digest differs from `stored`'s, names of those that match).
    Every file is checked before any is parsed, and any refusal raises: a caller writes nothing
    unless every file is good."""
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise BadFile(twice[0], "the same file name appears twice in one ingest")
    for f in files:
        check(f, max_bytes)
    docs, unchanged = [], []
    for f in files:
        if stored.get(f.name) == f.digest:
            unchanged.append(f.name)
        else:
            docs += read(f, max_bytes)
        if progress:
            progress(f)
    ids = [d.id for d in docs] + unchanged
    if len(set(ids)) != len(ids):
        raise RetrievalError("the same document id appears twice in one ingest (a file name and a JSONL row's id?)")
    return docs, unchanged


def load(path: str | Path, doc_id: str | None = None, max_bytes: int | None = None) -> list[Document]:
    """The documents in a file on disk; the id defaults to the file's name."""
    path = Path(path)
    return read(File(doc_id or path.name, path.read_bytes()), max_bytes)


def _text(file: File) -> str:
    try:
        return file.data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadFile(file.name, f"not UTF-8 text (byte {e.start:,} cannot be decoded)", "unsupported_type") from None
