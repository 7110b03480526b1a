"""Ingest of real documents nobody here wrote: PDF manuals from Debian's packages.

    python benchmarks/ingest_bench.py [--ask] [--packages PKG ...] [--out benchmarks/results/ingest_bench.json]

The folder: every PDF manual under /usr/share/doc that the machine has among MANUALS
(libtasn1-doc and shared-mime-info ship theirs as they are, the others gzipped: unpacked into
a temporary folder). Measured on the threads torch is given (2 here):

- the first ingest, as `sluice ingest` runs it (retrieval.read_changed, then Collection.ingest):
  pages per second extracted, chunks per second embedded;
- the same folder ingested again, unchanged: its time against the first, as a ratio (target >= 20x);
- the share of chunks holding a running header or footer, or a word broken by hyphenation
  (target <= 1%), counted by a check independent of the extractor: poppler's pdftotext reads each
  page, and a line at the same place among the two at a page's top or bottom (digits masked, a
  page number at either end dropped) is a running line when it recurs there on three pages, or
  on two if it carries a page number, and never stands in a page's middle; a chunk is counted
  if such a line stands alone as a line of it, or a printed page number does between lines
  that meet at a page break, or a lowercase word ends a line with "-" and the next line goes
  on in lowercase;
- with --ask: `sluice serve` with SmolLM2-135M answering (the citations come from retrieval, not
  from the model), the two uncompressed manuals uploaded through POST /v1/collections/{name}/files,
  and QUESTIONS asked through /v1/ask: a citation is right when the best-scored passage's pages
  hold the page the answer is on (strict: it starts there too).
"""
from __future__ import annotations

import argparse
import gzip
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, machine, sluice_server, smollm_setup, write_results  # noqa: E402

DOC = Path("/usr/share/doc")
MANUALS = {  # Debian package: its PDF manual
    "libtasn1-doc": DOC / "libtasn1-doc/libtasn1.pdf",
    "shared-mime-info": DOC / "shared-mime-info/shared-mime-info-spec.pdf",
    "nettle-dev": DOC / "nettle-dev/nettle.pdf.gz",
    "fontconfig": DOC / "fontconfig/fontconfig-user.pdf.gz",
    "bzip2": DOC / "bzip2/manual.pdf.gz",
    "zlib1g-dev": DOC / "zlib1g-dev/crc-doc.1.0.pdf.gz",
}
# (file, question, the page its answer is on: the PDF's own page order, from 1). Written by
# reading the manuals; pages checked with pdftotext.
QUESTIONS = [
    ("libtasn1.pdf", "Which ITU-T recommendation specifies the ASN.1 that libtasn1 parses?", 4),
    ("libtasn1.pdf", "Under which license may the libtasn1 library be redistributed?", 4),
    ("libtasn1.pdf", "Are C-style /* */ comments supported by the libtasn1 ASN.1 parser?", 5),
    ("libtasn1.pdf", "Does libtasn1 handle the REAL type and AUTOMATIC TAGS?", 6),
    ("libtasn1.pdf", "How is the Group type of the Example definition named when accessed?", 6),
    ("libtasn1.pdf", "What is the header file of the libtasn1 library?", 7),
    ("libtasn1.pdf", "Which asn1Parser option checks the syntax only?", 8),
    ("libtasn1.pdf", "What does the asn1Coding command generate?", 8),
    ("libtasn1.pdf", "Which asn1Decoding option performs a benchmark on decoding?", 10),
    ("libtasn1.pdf", "What does asn1_parser2tree return if an error occurred while opening the file?", 11),
    ("libtasn1.pdf", "What does asn1_array2tree do with the array of ASN.1 declarations?", 12),
    ("libtasn1.pdf", "What does asn1_create_element return if source_name is not known?", 13),
    ("libtasn1.pdf", "What does asn1_find_structure_from_oid return when the oidValue is not found?", 13),
    ("libtasn1.pdf", "What does asn1_get_length_der return on indefinite length?", 21),
    ("libtasn1.pdf", "Since which version is asn1_get_length_ber available?", 21),
    ("libtasn1.pdf", "Since which version does asn1_perror exist?", 25),
    ("libtasn1.pdf", "What does asn1_check_version return?", 26),
    ("shared-mime-info-spec.pdf", "Which version of the Shared MIME-info Database specification is this?", 1),
    ("shared-mime-info-spec.pdf", "Does the shared MIME database store user preferences?", 1),
    ("shared-mime-info-spec.pdf", "Which command must an application run after installing its MIME XML file?", 3),
    ("shared-mime-info-spec.pdf", "Which file takes precedence over the others in the same packages directory?", 3),
    ("shared-mime-info-spec.pdf", "What are the default and the maximum weight of a glob element?", 4),
    ("shared-mime-info-spec.pdf", "Which alias does audio/midi have?", 5),
    ("shared-mime-info-spec.pdf", "How is glob-deleteall written out into the globs2 file?", 8),
    ("shared-mime-info-spec.pdf", "Which magic string does the magic file start with?", 9),
    ("shared-mime-info-spec.pdf", "How is the magic-deleteall attribute written out into the magic file?", 10),
    ("shared-mime-info-spec.pdf", "Which magic string does the treemagic file start with?", 10),
    ("shared-mime-info-spec.pdf", "In which byte order are numbers stored in the mime.cache files?", 13),
    ("shared-mime-info-spec.pdf", "Which extended attribute may hold a file's MIME type?", 14),
    ("shared-mime-info-spec.pdf", "Which type are all text/* types subclasses of?", 14),
    ("shared-mime-info-spec.pdf", "How many bytes are checked for control characters to guess binary or text?", 15),
    ("shared-mime-info-spec.pdf", "How can a mounted directory be detected?", 16),
    ("shared-mime-info-spec.pdf", "Which MIME type do applications that handle a URI scheme like mms:// register?", 16),
]
KEY = "sk-ingest-bench"


def corpus(folder: Path, packages: list[str]) -> dict[str, Path]:
    """The manuals this machine has, as PDF files in `folder`; the packages missing are named."""
    found = {}
    for package, path in MANUALS.items():
        if package not in packages:
            continue
        if not path.exists():
            print(f"skipped: {path} absent (Debian package {package})")
            continue
        target = folder / path.name.removesuffix(".gz")
        if path.suffix == ".gz":
            with gzip.open(path) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy(path, target)
        found[package] = target
    return found


def pdf_pages(path: Path) -> list[str]:
    """Each page's text by poppler's pdftotext, the independent reader of the check."""
    out = subprocess.run(["pdftotext", "-layout", str(path), "-"], capture_output=True, text=True, check=True)
    return out.stdout.split("\f")[:-1]


PAGE_NUMBER = re.compile(r"^(\d+|[ivxlc]+)\b|\b(\d+|[ivxlc]+)$")


def mask(line: str) -> str:
    """Digits masked, and a page number at either end dropped: "chapter #: utilities"."""
    return re.sub(r"^(?:# )+|(?: #)+$", "", re.sub(r"\d+", "#", " ".join(line.split()).lower()))


def edges(page: str) -> list[tuple[int, str]]:
    lines = [" ".join(x.split()).lower() for x in page.splitlines() if x.strip()]
    return [(i, lines[i]) for i in (0, 1, -2, -1) if -len(lines) <= i < len(lines)]


def running_lines(pages: list[str]) -> set[str]:
    """Lines a page's layout repeats at the same place and the text never holds elsewhere. An API
    manual's "Possible return values:" sits at the edge of many pages, and in their middle too:
    content, not a header. A chapter's running head on its only two pages carries the page
    number, and so counts."""
    seen, numbered, body = Counter(), set(), set()
    for page in pages:
        at_edge = edges(page)
        for i, line in set(at_edge):
            seen[i, mask(line)] += 1
            if re.search(r"^\d+\s|\s\d+$", line):
                numbered.add((i, mask(line)))
        lines = [x for x in page.splitlines() if x.strip()]
        body.update(mask(x) for x in lines[2:-2])
    return {k for (i, k), n in seen.items()
            if len(k) >= 4 and k not in body and (n >= 3 or n >= 2 and (i, k) in numbered)}


def page_numbers(pages: list[str], running: set[str]) -> list[dict[str, set[str]]]:
    """Per page, its printed number (an edge line that is only a number or roman numeral, or the
    number a running line carries; not the PDF's page index: a table of contents on page 3 is
    printed "i") -> the lines around it across the page break, masked: the last lines of its page
    and the first of the next (or the page before, for a number at the top). A leaked page
    number stands between them; the same figure in a table, a code listing's line numbers or a
    contents entry does not."""
    out: list[dict[str, set[str]]] = [{} for _ in pages]
    text = [[x for x in page.splitlines() if x.strip()] for page in pages]
    for q, page in enumerate(pages):
        for i, line in edges(page):
            if (m := PAGE_NUMBER.search(line)) and (m.group(0) == line or mask(line) in running):
                before = text[q - 1][-3:] if q else []
                after = text[q + 1][:3] if q + 1 < len(text) else []
                near = (before + text[q][:3]) if i >= 0 else (text[q][-3:] + after)
                out[q].setdefault(m.group(1) or m.group(2), set()).update(
                    mask(x) for x in near if not PAGE_NUMBER.fullmatch(" ".join(x.split()).lower()))
    return out


BROKEN = re.compile(r"[a-z]{2,}-\n[a-z]{2,}")


def check_chunks(chunks, pages: list[str]) -> dict:
    """Chunks holding a running line as a line of their own, their page's printed number, or a
    word broken by a hyphen at a line end."""
    running = running_lines(pages)
    numbers_at = page_numbers(pages, running)
    heads, numbers, broken, examples = 0, 0, 0, []
    for c in chunks:
        lines = [mask(x) for x in c.text.splitlines() if x.strip()]
        head = any(x in running for x in lines)
        bare = [x.strip().lower() for x in c.text.splitlines() if x.strip()]
        spanned = range((c.page or 1) - 1, min(c.page_end or c.page or 1, len(pages)))
        number = any(x in numbers_at[q] and numbers_at[q][x] & set(lines[max(j - 1, 0):j] + lines[j + 1:j + 2])
                     for q in spanned for j, x in enumerate(bare))
        hyphen = bool(BROKEN.search(c.text))
        heads, numbers, broken = heads + head, numbers + number, broken + hyphen
        if (head or number or hyphen) and len(examples) < 5:
            examples.append(c.text[:160])
    return {"chunks": len(chunks), "running_header_footer": heads, "page_number": numbers,
            "broken_hyphenation": broken, "running_lines_found": len(running), "examples": examples}


def ingest(folder: Path, data: Path) -> dict:
    from retrieval import CollectionStore, Embedder, File, read_changed
    store = CollectionStore(data, Embedder(device="cpu"))
    files = [File(p.name, p.read_bytes()) for p in sorted(folder.glob("*.pdf"))]
    start = time.perf_counter()
    docs, unchanged = read_changed(files, {})
    read_s = time.perf_counter() - start
    collection = store.collection("bench", "manuals")
    start = time.perf_counter()
    report = collection.ingest(docs, unchanged=unchanged)
    embed_s = time.perf_counter() - start
    pages = sum(max(s.page for s in d.spans) for d in docs)
    start = time.perf_counter()
    again_docs, again_unchanged = read_changed([File(p.name, p.read_bytes()) for p in sorted(folder.glob("*.pdf"))],
                                               collection.digests())
    again = collection.ingest(again_docs, unchanged=again_unchanged)
    again_s = time.perf_counter() - start
    checks = {}
    for f in files:
        checks[f.name] = check_chunks(collection.chunks(f.name), pdf_pages(folder / f.name))
    store.close()
    first_s = read_s + embed_s
    return {"files": len(files), "pages": pages, "read_s": read_s, "pages_per_s": pages / read_s,
            "chunks": report.chunks, "embedded": report.embedded, "embed_s": embed_s,
            "chunks_per_s": report.embedded / embed_s, "first_ingest_s": first_s,
            "reingest_s": again_s, "reingest_unchanged": again.unchanged, "reingest_embedded": again.embedded,
            "reingest_speedup": first_s / again_s, "checks": checks}


def ask(folder: Path, work: Path) -> dict:
    args = smollm_setup(work, {"bench": KEY}, output_tokens=1)
    tenant = work / "tenants" / "bench.toml"
    tenant.write_text(tenant.read_text().replace("context_budget = 400", "context_budget = 1024"))
    headers = {"Authorization": f"Bearer {KEY}"}
    rows = []
    with sluice_server(args, work / "server.log") as server:
        names = sorted({q[0] for q in QUESTIONS})
        files = [("files", (n, (folder / n).read_bytes(), "application/pdf")) for n in names]
        r = httpx.post(f"{server.url}/v1/collections/manuals/files", files=files, headers=headers, timeout=600)
        r.raise_for_status()
        for doc_id, question, page in QUESTIONS:
            r = httpx.post(f"{server.url}/v1/ask", headers=headers, timeout=300, json={
                "question": question, "collection": "manuals", "max_output_tokens": 1, "mode": "small"})
            r.raise_for_status()
            cites = r.json()["citations"]
            best = max(cites, key=lambda c: c["score"])
            rows.append({"doc_id": doc_id, "question": question, "page": page, "cited": [best["doc_id"], best["page"],
                                                                                          best["page_end"]],
                         "right": best["doc_id"] == doc_id and best["page"] <= page <= best["page_end"],
                         "strict": best["doc_id"] == doc_id and best["page"] == page,
                         "any": any(c["doc_id"] == doc_id and c["page"] <= page <= c["page_end"] for c in cites)})
    n = len(rows)
    return {"questions": n, "right": sum(r["right"] for r in rows) / n, "strict": sum(r["strict"] for r in rows) / n,
            "any_citation": sum(r["any"] for r in rows) / n, "misses": [r for r in rows if not r["right"]],
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ask", action="store_true", help="also ask QUESTIONS through /v1/ask (SmolLM2-135M)")
    parser.add_argument("--packages", nargs="+", default=sorted(MANUALS), choices=sorted(MANUALS),
                        help="the manuals to ingest (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS / "ingest_bench.json")
    args = parser.parse_args()
    if shutil.which("pdftotext") is None:
        raise SystemExit("the check needs poppler's pdftotext: apt-get install poppler-utils")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "pdf").mkdir()
        found = corpus(tmp / "pdf", args.packages)
        if not found:
            raise SystemExit("no manual found: apt-get install " + " ".join(MANUALS))
        results = {"machine": machine(), "packages": sorted(found), **ingest(tmp / "pdf", tmp / "data")}
        if args.ask:
            (tmp / "serve").mkdir()
            results["ask"] = ask(tmp / "pdf", tmp / "serve")
    c = results["checks"]
    total = sum(x["chunks"] for x in c.values())
    bad = {k: sum(x[k] for x in c.values()) for k in ("running_header_footer", "page_number", "broken_hyphenation")}
    results["bad_chunk_share"] = {k: v / total for k, v in bad.items()}
    print(f"\n{results['files']} manuals, {results['pages']} pages, {results['chunks']} chunks "
          f"({torch.get_num_threads()} threads)")
    print(f"{'':34}{'seconds':>10}{'rate':>16}{'vs first':>10}")
    print(f"{'first ingest: extract':34}{results['read_s']:10.1f}{results['pages_per_s']:11.1f} p/s")
    print(f"{'first ingest: chunk and embed':34}{results['embed_s']:10.1f}{results['chunks_per_s']:11.1f} ch/s")
    print(f"{'first ingest, all':34}{results['first_ingest_s']:10.1f}{'':16}{1.0:9.2f}x")
    print(f"{'again, unchanged':34}{results['reingest_s']:10.2f}{'':16}{results['reingest_speedup']:9.0f}x faster")
    for k, v in bad.items():
        print(f"chunks with {k.replace('_', ' ')}: {v} of {total} ({v / total:.1%})")
    if "ask" in results:
        a = results["ask"]
        print(f"citations at the right page: {a['right']:.0%} of {a['questions']} (strict {a['strict']:.0%}, "
              f"any citation {a['any_citation']:.0%})")
        for m in a["misses"]:
            print(f"  miss: {m['doc_id']} p{m['page']}: {m['question']} -> cited {m['cited']}")
    write_results(args.out, results)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
