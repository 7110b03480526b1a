"""POST /v1/collections/{name}/files: PDF and Word uploads cited by page and heading, re-uploads
that skip unchanged files, and bad files refused by name with the collection left as it was."""
from __future__ import annotations

import functools

import pytest
from litestar.testing import TestClient

from gateway.http.app import create_app
from tests.document_files import docx, pdf, zip_bomb
from tests.test_gateway_support import KEYS, auth, embedder, llm, make_gateway, tenant_toml, wait_ready  # noqa: F401
from tests.test_retrieval_files import manual

URL = "/v1/collections/manuals/files"


@pytest.fixture
def client(tmp_path, llm, embedder):
    tenants = {"alpha": tenant_toml(KEYS["alpha"]) + "max_file_bytes = 60000\n", "beta": tenant_toml(KEYS["beta"])}
    with TestClient(create_app(make_gateway(tmp_path, llm, embedder, tenants))) as c:
        wait_ready(c)
        yield c


def upload(client, *files, tenant="alpha"):
    return client.post(URL, files=[("files", f) for f in files], headers=auth(tenant))


@functools.cache
def guide() -> bytes:
    """(Made once: a Word file written again differs in its timestamps.)"""
    steps = [("p", f"Step {i}: check the {w} cable before you go on.") for i, w in enumerate(["red", "blue", "green",
             "black", "white", "grey", "brown", "pink", "gold", "silver", "orange", "purple"] * 3)]
    return docx([("h1", "Install"), ("p", "Run the installer as root."), *steps, ("h2", "Linux"),
                 ("p", "On Linux the widget daemon listens on port 7311.")], title="Widget Guide")


def test_uploads_are_cited_by_page_and_heading_and_unchanged_files_are_skipped(client):
    r = upload(client, ("manual.pdf", manual(), "application/pdf"), ("guide.docx", guide(), "application/octet-stream"))
    assert r.status_code == 200, r.text
    first = r.json()
    assert (first["documents"], first["added"], first["unchanged"], first["embedded"]) == (2, 2, 0, first["chunks"])

    r = client.post("/v1/ask", json={"question": "What is the secret word on page three?", "collection": "manuals",
                                     "max_output_tokens": 2}, headers=auth())
    assert r.status_code == 200, r.text
    cites = {c["doc_id"]: c for c in r.json()["citations"]}
    assert cites["manual.pdf"]["page"] is not None and cites["manual.pdf"]["section"] is None
    best = max(r.json()["citations"], key=lambda c: c["score"])
    assert best["doc_id"] == "manual.pdf" and best["page"] <= 3 <= best["page_end"]
    r = client.post("/v1/ask", json={"question": "Which port does the widget daemon listen on under Linux?",
                                     "collection": "manuals", "max_output_tokens": 2}, headers=auth())
    best = max(r.json()["citations"], key=lambda c: c["score"])
    assert (best["doc_id"], best["section"], best["page"]) == ("guide.docx", "Install > Linux", None)

    again = upload(client, ("manual.pdf", manual()), ("guide.docx", guide())).json()
    assert (again["unchanged"], again["embedded"], again["chunks"]) == (2, 0, first["chunks"])
    notes = upload(client, ("notes.md", b"# Notes\n\nOtters hold hands."), ("guide.docx", guide())).json()
    assert (notes["added"], notes["unchanged"]) == (1, 1)
    metrics = client.get("/metrics").text
    assert 'sluice_ingested_documents_total{tenant="alpha",outcome="unchanged"} 3' in metrics
    assert f'sluice_embedded_chunks_total{{tenant="alpha"}} {first["embedded"] + notes["embedded"]}' in metrics


@pytest.mark.parametrize("name, data, status, code, reason", [
    ("empty.txt", b"", 422, "file_empty", "empty.txt: the file is empty (0 bytes)"),
    ("big.md", b"x" * 60_001, 413, "file_too_large", "big.md: 60,001 bytes is over the limit of 60,000 bytes"),
    ("locked.pdf", pdf([["Secret."]], password="pw"), 422, "file_unreadable", "locked.pdf: encrypted"),
    ("broken.pdf", b"%PDF-1.7 no objects at all", 422, "file_unreadable", "broken.pdf: not a readable PDF"),
    ("bomb.docx", zip_bomb(16 * 2**20), 422, "file_unreadable", "bomb.docx: refused as a ZIP bomb"),
    ("photo.jpg", b"\xff\xd8\xff\xe0" + bytes(64), 422, "file_unsupported_type", "photo.jpg: not a type Sluice reads"),
])
def test_a_bad_file_is_refused_by_name_and_the_collection_is_left_as_it_was(client, name, data, status, code, reason):
    assert upload(client, ("notes.md", b"# Notes\n\nLions sleep.")).status_code == 200
    before = client.get("/v1/collections", headers=auth()).json()
    r = upload(client, ("notes.md", b"# Notes\n\nChanged text."), (name, data))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, "files") and error["message"].startswith(reason)
    assert client.get("/v1/collections", headers=auth()).json() == before
    assert upload(client, ("notes.md", b"# Notes\n\nLions sleep.")).json()["unchanged"] == 1   # not replaced


def test_a_refused_first_upload_creates_no_collection_and_limits_are_per_tenant(client):
    big = ("big.md", b"# Big\n\n" + b"Lions sleep a lot. " * 3200)
    assert upload(client, big).status_code == 413
    assert client.get("/v1/collections", headers=auth()).json() == {"collections": []}
    assert upload(client, big, tenant="beta").status_code == 200            # beta keeps the default 16 MiB
    assert client.post(URL, json={"documents": []}, headers=auth()).status_code == 415
    assert client.post(URL, headers=auth()).status_code == 415
    form = {**auth(), "Content-Type": "multipart/form-data; boundary=b"}
    empty = client.post(URL, content=b"--b--\r\n", headers=form)
    assert empty.status_code == 422 and empty.json()["error"]["code"] == "no_files"
    mixed = client.post(URL, data={"note": "text"}, files=[("files", ("a.md", b"# A"))], headers=auth())
    assert mixed.status_code == 422 and mixed.json()["error"]["code"] == "not_a_file"
    assert client.post(URL, files=[("files", ("a.md", b"x"))]).status_code == 401


def test_the_upload_is_in_the_openapi_schema(client):
    op = client.get("/schema/openapi.json").json()["paths"][URL.replace("manuals", "{name}")]["post"]
    assert "multipart/form-data" in op["requestBody"]["content"]
    assert {"200", "413", "415", "422"} <= set(op["responses"])
