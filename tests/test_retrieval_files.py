"""Files as people have them: PDFs and Word files the tests write (text on known pages, a header
on every page, a two-column page, hyphenation), Debian's real PDF manuals, bad files refused by
name and reason, and re-ingest that skips unchanged files and swaps changed ones atomically."""
import re
import threading
from pathlib import Path

import pytest

from retrieval import BadFile, Collection, CollectionConfig, File, chunk, read, read_changed
from tests.document_files import HEADER, docx, pdf, scanned_pdf, zip_bomb
from tests.test_retrieval_collection import HashEmbedder
from tests.test_retrieval_documents import MINILM

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango").split()
# Real manuals from Debian packages (`make test` installs them): no one here wrote them.
MANUALS = {"libtasn1-doc": Path("/usr/share/doc/libtasn1-doc/libtasn1.pdf"),
           "shared-mime-info": Path("/usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf")}


def body(page: int, lines: int = 5) -> list[str]:
    return [f"{WORDS[(page * lines + i) % len(WORDS)].title()} is word {i} noted on this page." for i in range(lines)]


def manual() -> bytes:
    """Four pages under a running header and "Page n of N" footer; page 2 in two columns;
    page 3 holds a fact and a word hyphenated across a line break."""
    pages = [body(0), [], ["The secret word on page three is pineapple.", "The widget stores its configu-",
                           "ration files under the etc folder."], body(3)]
    left = ["Left column starts here and", "left column goes on here.", "", "A second left paragraph",
            "ends the left column."]
    right = ["Right column comes second and", "right column goes on.", "", "A second right paragraph",
             "ends the page."]
    return pdf(pages, two_columns={1: (left, right)})


def test_pdf_pages_reading_order_headers_and_hyphenation():
    [doc] = read(File("manual.pdf", manual()))
    assert doc.title == "Widget Manual" and doc.id == "manual.pdf"
    assert HEADER not in doc.text and "Page 1 of 4" not in doc.text and "of 4" not in doc.text
    assert "configuration files" in doc.text and "configu-" not in doc.text
    columns = ["Left column starts here", "A second left paragraph", "Right column comes second",
               "A second right paragraph", "The secret word"]
    assert [doc.text.index(c) for c in columns] == sorted(doc.text.index(c) for c in columns)
    for line in body(0) + body(3):      # body lines at the edges stay, though they look alike
        assert line in doc.text
    chunks = chunk(doc, MINILM, size=24, overlap=0)
    secret = next(c for c in chunks if "pineapple" in c.text)
    assert secret.page <= 3 == secret.page_end      # a chunk may start on the page before and run on
    assert next(c for c in chunks if "Tango" in c.text).page == 4
    assert {c.page for c in chunks} == {1, 2, 3, 4} and all(c.page <= c.page_end for c in chunks)


def test_word_files_become_markdown_with_heading_paths():
    data = docx([("h1", "Install"), ("p", "Run the installer as root."), ("h2", "Linux"),
                 ("li", "apt install widget"), ("li", "systemctl start widget"), ("table", "OS;Command/Linux;apt"),
                 ("h1", "Support"), ("p", "Mail the help desk.")], title="Widget Guide")
    [doc] = read(File("guide.docx", data))
    assert doc.title == "Widget Guide"
    assert doc.text == ("# Install\n\nRun the installer as root.\n\n## Linux\n\n- apt install widget\n"
                        "- systemctl start widget\n\n| OS | Command |\n| Linux | apt |\n\n# Support\n\n"
                        "Mail the help desk.")
    sections = {c.text.splitlines()[-1]: c.section for c in chunk(doc, MINILM, size=12, overlap=0)}
    assert sections["Mail the help desk."] == "Support"
    assert [s.section for s in doc.spans] == ["Install", "Install > Linux", "Support"]


def test_the_type_comes_from_the_content_then_the_name():
    assert File("notes", manual()).kind == "pdf"                          # no suffix: the bytes say PDF
    assert File("scan.txt", manual()).kind == "pdf"
    assert File("page", b"<!DOCTYPE html><html><body>x</body></html>").kind == "html"
    assert File("README", b"plain words").kind == "text"
    assert File("guide.md", b"# Title").kind == "markdown"


@pytest.mark.parametrize("file, code, reason", [
    (File("empty.txt", b""), "empty", "empty.txt: the file is empty"),
    (File("big.md", b"x" * 101), "too_large", "big.md: 101 bytes is over the limit of 100 bytes"),
    (File("locked.pdf", pdf([["Top secret text."]], password="pw")), "unreadable", "locked.pdf: encrypted"),
    (File("scan.pdf", scanned_pdf()), "unreadable", "scan.pdf: no text layer on any of its 2 page"),
    (File("broken.pdf", b"%PDF-1.7\n1 0 obj << /Type /Catalog"), "unreadable", "broken.pdf: not a readable PDF"),
    (File("cut.pdf", manual()[:3000]), "unreadable", "cut.pdf: "),
    (File("bomb.docx", zip_bomb()), "unreadable", "bomb.docx: refused as a ZIP bomb"),
    (File("old.doc", b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(600)), "unsupported_type", "old.doc: an Office file"),
    (File("fake.docx", b"PK\x03\x04 not really a zip"), "unreadable", "fake.docx: not a readable Word file"),
    (File("data.zip", b"PK\x03\x04" + bytes(30)), "unreadable", "data.zip: not a readable Word file"),
    (File("photo.jpg", b"\xff\xd8\xff\xe0" + bytes(100)), "unsupported_type", "photo.jpg: not a type Sluice reads"),
    (File("sheet.csv", b"a,b\n1,2"), "unsupported_type", "sheet.csv: unsupported document type '.csv'"),
])
def test_bad_files_are_refused_by_name_and_reason(file, code, reason):
    with pytest.raises(BadFile, match=re.escape(reason)) as e:
        read(file, max_bytes=100 if file.name == "big.md" else None)
    assert e.value.code == code


def test_a_bad_file_leaves_the_collection_exactly_as_it_was(tmp_path):
    c = Collection(tmp_path / "c", HashEmbedder(), CollectionConfig(chunk_size=32, chunk_overlap=0))
    docs, unchanged = read_changed([File("a.txt", b"Old text about lions.")], {})
    c.ingest(docs, unchanged=unchanged)
    before = (c.digests(), [ch.text for ch in c.chunks("a.txt")], c._meta("version"))
    files = [File("a.txt", b"New text about zebras."), File("b.pdf", b"%PDF-1.4 broken")]
    with pytest.raises(BadFile, match="b.pdf: not a readable PDF"):
        read_changed(files, c.digests())
    with pytest.raises(BadFile, match="twice"):
        read_changed([File("a.txt", b"x"), File("a.txt", b"y")], {})
    assert (c.digests(), [ch.text for ch in c.chunks("a.txt")], c._meta("version")) == before


def test_reingest_skips_unchanged_files_and_replaces_changed_ones(tmp_path):
    c = Collection(tmp_path / "c", HashEmbedder(), CollectionConfig(chunk_size=32, chunk_overlap=0))
    files = [File("manual.pdf", manual()), File("notes.md", b"# Notes\n\nLions sleep a lot."),
             File("guide.docx", docx([("h1", "Guide"), ("p", "Zebras run fast.")]))]
    first = c.ingest(*read_changed(files, c.digests())[:1])
    assert (first.added, first.replaced, first.unchanged, first.embedded) == (3, 0, 0, first.chunks)
    read_files = []
    docs, unchanged = read_changed(files, c.digests(), progress=read_files.append)
    assert docs == [] and unchanged == ["manual.pdf", "notes.md", "guide.docx"] and len(read_files) == 3
    again = c.ingest(docs, unchanged=unchanged)
    assert (again.added, again.replaced, again.unchanged, again.embedded, again.chunks) == (0, 0, 3, 0, first.chunks)

    files[1] = File("notes.md", b"# Notes\n\nLions sleep a lot.\n\n## More\n\nOtters hold hands.")
    docs, unchanged = read_changed(files, c.digests())
    assert [d.id for d in docs] == ["notes.md"]                 # only the changed file was read
    changed = c.ingest(docs, unchanged=unchanged)
    assert (changed.added, changed.replaced, changed.unchanged, changed.removed) == (0, 1, 2, 1)
    assert [(ch.section, "Otters" in ch.text) for ch in c.chunks("notes.md")] == [("Notes", False),
                                                                                   ("Notes > More", True)]
    hit = c.search("pineapple secret word", 1, "bm25")[0].chunk
    assert (hit.doc_id, hit.page) == ("manual.pdf", 3)               # pages survive storage


def test_a_search_during_reingest_sees_the_old_or_the_new_version_never_a_mix(tmp_path):
    """Searches run while a 40-chunk document is replaced again and again: every result set is
    all old chunks or all new ones, and never empty."""
    c = Collection(tmp_path / "c", HashEmbedder(), CollectionConfig(chunk_size=8, chunk_overlap=0))
    version = lambda v: File("doc.txt", "\n\n".join(f"Version {v} paragraph {i} about ferns." for i in range(40))
                             .encode())
    c.ingest(read_changed([version(0)], {})[0])
    stop, seen, problems = threading.Event(), set(), []

    def search():
        while not stop.is_set():
            hits = c.search("paragraph about ferns", 60, "bm25")
            versions = {re.search(r"Version (\d+)", h.chunk.text).group(1) for h in hits}
            if len(hits) != 40 or len(versions) != 1:
                problems.append((len(hits), versions))
            seen.update(versions)

    searcher = threading.Thread(target=search)
    searcher.start()
    try:
        for v in range(1, 8):
            report = c.ingest(read_changed([version(v)], c.digests())[0])
            assert (report.replaced, report.removed, report.chunks) == (1, 40, 40)
    finally:
        stop.set()
        searcher.join()
    assert problems == [] and len(seen) >= 2


@pytest.mark.parametrize("package", sorted(MANUALS))
def test_real_manuals_from_debian(package):
    path = MANUALS[package]
    if not path.exists():
        pytest.skip(f"Debian package {package} is not installed ({path} absent); `make test` installs it")
    [doc] = read(File(path.name, path.read_bytes()))
    pages = max(s.page for s in doc.spans)
    assert pages >= 15 and len(doc.text) > 30_000
    if package == "libtasn1-doc":
        assert "Chapter 2: ASN.1 structure handling" not in doc.text      # the running header
        assert "asn1_create_element" in doc.text
    else:
        assert "Shared MIME-info Database\n" not in doc.text and "magic" in doc.text
    assert not re.search(r"[a-z]-\n[a-z]", doc.text)
