"""PDF and Word files made by the tests (reportlab, python-docx), with known text on known pages."""
from __future__ import annotations

import io
import zipfile

HEADER = "ACME Widget Manual - Internal"


def pdf(pages: list[list[str]], header: str | None = HEADER, footer: bool = True, two_columns: dict | None = None,
        password: str | None = None, title: str = "Widget Manual") -> bytes:
    """A PDF with one line of `pages[i]` per row; every page carries `header` at the top and
    "Page n of N" at the bottom. `two_columns` {page index: (left lines, right lines)} draws that
    page as two columns, row by row across both (left 1, right 1, left 2, ...), so only layout
    analysis can give the reading order."""
    from reportlab.lib.pagesizes import letter
    from reportlab.pdfgen import canvas
    buf = io.BytesIO()
    encrypt = None
    if password:
        from reportlab.lib.pdfencrypt import StandardEncryption
        encrypt = StandardEncryption(password, ownerPassword="owner-" + password)
    c = canvas.Canvas(buf, pagesize=letter, encrypt=encrypt, invariant=True)  # the same bytes every time
    c.setTitle(title)
    width, height = letter
    for n, lines in enumerate(pages):
        c.setFont("Helvetica", 11)
        if header:
            c.drawString(72, height - 40, header)
        y = height - 90
        if two_columns and n in two_columns:
            left, right = two_columns[n]
            for a, b in zip(left, right):
                c.drawString(72, y, a)
                c.drawString(width / 2 + 18, y, b)
                y -= 14
        for line in lines:
            c.drawString(72, y, line)
            y -= 14
        if footer:
            c.drawString(width / 2 - 30, 30, f"Page {n + 1} of {len(pages)}")
        c.showPage()
    c.save()
    return buf.getvalue()


def scanned_pdf(pages: int = 2) -> bytes:
    """Pages holding only drawings (as a scan holds only images): no text layer."""
    from reportlab.lib.pagesizes import letter
    from reportlab.pdfgen import canvas
    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=letter, invariant=True)
    for _ in range(pages):
        for i in range(20):
            c.rect(72, 700 - 14 * i, 400, 8, fill=1)
        c.showPage()
    c.save()
    return buf.getvalue()


def docx(blocks: list[tuple[str, str]], title: str = "") -> bytes:
    """A Word file from (kind, text) blocks: kind "h1".."h3", "p", "li", or "table" (rows by
    "/" and cells by ";")."""
    import docx as python_docx
    document = python_docx.Document()
    document.core_properties.title = title
    for kind, text in blocks:
        if kind.startswith("h"):
            document.add_heading(text, level=int(kind[1:]))
        elif kind == "li":
            document.add_paragraph(text, style="List Bullet")
        elif kind == "table":
            rows = [r.split(";") for r in text.split("/")]
            table = document.add_table(rows=len(rows), cols=len(rows[0]))
            for r, row in enumerate(rows):
                for k, cell in enumerate(row):
                    table.cell(r, k).text = cell
        else:
            document.add_paragraph(text)
    buf = io.BytesIO()
    document.save(buf)
    return buf.getvalue()


def zip_bomb(unpacked: int = 64 * 2**20) -> bytes:
    """A .docx-shaped ZIP whose document.xml unpacks to `unpacked` bytes of spaces (about 1,000x)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        with z.open("word/document.xml", "w", force_zip64=True) as f:
            block = b" " * 2**20
            for _ in range(unpacked // len(block)):
                f.write(block)
    return buf.getvalue()
