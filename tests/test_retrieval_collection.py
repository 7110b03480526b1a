"""Collections: ingest, re-ingest, delete, search, persistence, tenants, index kinds, crashes."""
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from retrieval import Collection, CollectionConfig, CollectionStore, Document, Embedder, RetrievalError
from retrieval import collection as collection_module

ROOT = Path(__file__).resolve().parents[1]

FACTS = {
    "eiffel": "The Eiffel Tower is a wrought-iron lattice tower in Paris, finished in 1889.",
    "python": "Python is a programming language created by Guido van Rossum.",
    "everest": "Mount Everest is the highest mountain above sea level, in the Himalayas.",
    "coffee": "Coffee is brewed from roasted beans of the Coffea plant.",
}


@pytest.fixture(scope="module")
def embedder():
    return Embedder(device="cpu")


def docs(**texts):
    return [Document(doc_id, text) for doc_id, text in texts.items()]


def top(collection, query, mode="hybrid", k=1):
    return [h.chunk.doc_id for h in collection.search(query, k, mode)]


class HashEmbedder:
    """Bag of hashed words: no model to load, for tests about storage rather than meaning."""
    dim = 64
    max_tokens = 256

    class tokenizer:
        @staticmethod
        def encode(text):
            return list(range(len(text.split())))

    def encode(self, texts):
        out = np.zeros((len(texts), self.dim), np.float32)
        for row, text in zip(out, texts):
            for word in text.lower().split():
                row[zlib.crc32(word.encode()) % self.dim] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def test_search_finds_the_document_in_every_mode(tmp_path, embedder):
    c = Collection(tmp_path / "c", embedder)
    assert c.ingest(docs(**FACTS)).chunks == 4
    for mode in ("dense", "bm25", "hybrid"):
        assert top(c, "Which mountain is the tallest in the world?", mode) == ["everest"]
        assert top(c, "Who created Python?", mode) == ["python"]
    hits = c.search("tower in Paris", k=10, mode="dense")
    assert len(hits) == 4 and [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    with pytest.raises(RetrievalError, match="unknown search mode 'fuzzy'"):
        c.search("x", mode="fuzzy")
    with pytest.raises(RetrievalError, match="query is empty"):
        c.search("  ")


def test_reingest_replaces_only_that_document(tmp_path, embedder):
    c = Collection(tmp_path / "c", embedder, CollectionConfig(chunk_size=16, chunk_overlap=0))
    long = " ".join(f"Sentence {i} is about gardening and roses." for i in range(6))
    c.ingest(docs(garden=long, **FACTS))
    others = {d: c.chunks(d) for d in FACTS}
    old = c.chunks("garden")
    assert [ch.id for ch in old] == [f"garden#{i}" for i in range(len(old))] and len(old) > 2
    # Change the last sentence only: the unchanged chunks keep their vectors.
    edited = long.replace("Sentence 5 is about gardening and roses.", "Tulips bloom in May.")
    report = c.ingest(docs(garden=edited))
    assert (report.removed, report.chunks, report.embedded) == (len(old), len(old), 1)
    assert c.chunks("garden")[:-1] == old[:-1] and "Tulips" in c.chunks("garden")[-1].text
    assert {d: c.chunks(d) for d in FACTS} == others
    assert top(c, "When do tulips bloom?") == ["garden"]
    assert all("Sentence 5" not in h.chunk.text for h in c.search("Sentence 5 gardening roses", 20))


def test_delete_removes_chunks_from_every_search(tmp_path, embedder):
    c = Collection(tmp_path / "c", embedder)
    c.ingest(docs(**FACTS, **{f"filler{i}": f"Filler note number {i} about nothing." for i in range(8)}))
    assert c.delete("eiffel") == 1 and c.delete("eiffel") == 0
    assert c.dead, "a single delete leaves a tombstone rather than rebuilding the index"
    for mode in ("dense", "bm25", "hybrid"):
        assert "eiffel" not in top(c, "Eiffel Tower Paris", mode, k=20)
    assert len(c) == 11 and "eiffel" not in c.doc_ids()


def test_collection_survives_reopening(tmp_path, embedder):
    store = CollectionStore(tmp_path, embedder)
    c = store.collection("acme", "kb", CollectionConfig(chunk_size=64))
    c.ingest(docs(**FACTS) + [Document("meta", "Tagged text about otters.", "Otters", {"tags": ["a"]})])
    c.delete("coffee")
    before = {q: c.search(q, 3) for q in ("Who created Python?", "otters")}
    index_files = sorted(p.name for p in c.path.glob("index-*.faiss"))
    store.close()

    again = CollectionStore(tmp_path, embedder).collection("acme", "kb")
    assert again.config == CollectionConfig(chunk_size=64)
    assert again.doc_ids() == ["eiffel", "everest", "meta", "python"]
    assert again.chunks("meta")[0].metadata == {"tags": ["a"]} and again.chunks("meta")[0].title == "Otters"
    assert {q: again.search(q, 3) for q in before} == before
    assert sorted(p.name for p in again.path.glob("index-*.faiss")) == index_files  # loaded, not rebuilt
    with pytest.raises(RetrievalError, match="exists with"):
        CollectionStore(tmp_path, embedder).collection("acme", "kb", CollectionConfig(chunk_size=32))


def test_tenants_never_see_each_other(tmp_path, embedder):
    store = CollectionStore(tmp_path, embedder)
    store.collection("alpha", "docs").ingest([Document("plan", "Alpha's secret plan is to sell turnips.")])
    store.collection("beta", "docs").ingest([Document("plan", "Beta plans to open a bakery.")])
    store.collection("beta", "other").ingest([Document("x", "Unrelated text.")])
    assert store.names("alpha") == ["docs"] and store.names("beta") == ["docs", "other"]
    hits = store.collection("beta", "docs").search("secret plan turnips", 5)
    assert [h.chunk.text for h in hits] == ["Beta plans to open a bakery."]
    for tenant, name in [("../alpha", "docs"), ("beta", "../../alpha/docs"), ("beta", ".hidden"),
                         ("", "docs"), ("beta", "a/b")]:
        with pytest.raises(RetrievalError, match="bad (tenant|collection) name"):
            store.collection(tenant, name)
    with pytest.raises(RetrievalError, match="tenant 'gamma' has no collection 'docs'"):
        store.collection("gamma", "docs", create=False)
    store.drop("beta", "docs")
    assert store.names("beta") == ["other"] and store.names("alpha") == ["docs"]
    assert store.collection("beta", "docs").doc_ids() == []


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_approximate_indexes_when_asked(tmp_path, kind):
    c = Collection(tmp_path / kind, HashEmbedder(), CollectionConfig(index=kind))
    texts = {f"d{i}": f"note {i} " + " ".join(f"topic{i}x{j}" for j in range(5)) for i in range(60)}
    c.ingest(docs(**texts))
    assert c.kind == kind
    assert all(top(c, texts[d], "dense") == [d] for d in ("d0", "d17", "d59"))
    c.delete("d17")
    assert "d17" not in top(c, texts["d17"], "dense", k=5)


def test_index_turns_to_hnsw_as_the_collection_grows(tmp_path, monkeypatch):
    monkeypatch.setattr(collection_module, "HNSW_FROM", 10)
    c = Collection(tmp_path / "c", HashEmbedder())
    c.ingest(docs(**{f"d{i}": f"text number {i}" for i in range(9)}))
    assert c.kind == "flat"
    c.ingest(docs(d9="text number nine", d10="text number ten"))
    assert c.kind == "hnsw" and top(c, "text number ten", "dense") == ["d10"]
    c.close()
    assert Collection(tmp_path / "c", HashEmbedder()).kind == "hnsw"


def test_bad_collection_input(tmp_path):
    c = Collection(tmp_path / "c", HashEmbedder())
    with pytest.raises(RetrievalError, match="nothing to ingest"):
        c.ingest([])
    with pytest.raises(RetrievalError, match="appears twice"):
        c.ingest(docs(a="x") + docs(a="y"))
    with pytest.raises(RetrievalError, match="unknown index kind 'lsh'"):
        Collection(tmp_path / "d", HashEmbedder(), CollectionConfig(index="lsh"))
    assert Collection(tmp_path / "d", HashEmbedder()).config == CollectionConfig()  # nothing bad was kept
    with pytest.raises(RetrievalError, match="chunk size 300 exceeds the embedder's 256-token window"):
        Collection(tmp_path / "e", HashEmbedder(), CollectionConfig(chunk_size=300))


CRASH = """
import os, sys
sys.path.insert(0, {root!r})
from tests.test_retrieval_collection import HashEmbedder
from retrieval import Document, collection as m

def in_transaction(self, chunks, vectors):  # old chunks deleted, new ones written, no commit
    real(self, chunks, vectors)
    os._exit(3)

def half_file(index, path):
    open(path, "wb").write(b"half an index")
    os._exit(3)

real = m.Collection._insert
if {point!r} == "in-transaction":
    m.Collection._insert = in_transaction
elif {point!r} == "before-index-file":
    m.faiss.write_index = lambda index, path: os._exit(3)
else:
    m.faiss.write_index = half_file
c = m.Collection({path!r}, HashEmbedder())
c.ingest([Document("a", "new text about zebras"), Document("c", "a third document")])
"""


@pytest.mark.parametrize("point", ["in-transaction", "before-index-file", "while-writing-index-file"])
def test_a_crash_mid_ingest_never_serves_a_half_written_collection(tmp_path, point):
    path = tmp_path / "c"
    c = Collection(path, HashEmbedder())
    c.ingest(docs(a="old text about lions", b="another document"))
    c.close()
    run = subprocess.run([sys.executable, "-c", CRASH.format(root=str(ROOT), path=str(path), point=point)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr

    c = Collection(path, HashEmbedder())
    texts = sorted(h.chunk.text for h in c.search("text about document", 10, "dense"))
    if point == "in-transaction":  # never committed: the old state, whole
        assert c.doc_ids() == ["a", "b"] and texts == ["another document", "old text about lions"]
    else:  # committed, index file missing or partial: rebuilt from SQLite
        assert c.doc_ids() == ["a", "b", "c"]
        assert texts == ["a third document", "another document", "new text about zebras"]
    assert [p.name for p in path.glob("*index*")] == [f"index-{c._meta('version')}.faiss"]
    assert c.index.ntotal == len(c) + len(c.dead)
