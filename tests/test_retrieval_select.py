"""Passage selection: the sentences that bear on the question fill the budget, exactly, in
document order, under their chunk's id; the lead passes untouched; no selector changes nothing."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval import Chunk, Passage, RagContext, RetrievalError, SearchHit, Selector, build_prompt, rag_context, trim
from retrieval.select import GAP
from retrieval.trim import TrimResult
from tests.test_retrieval_trim import MINILM, TOKENIZERS, Words, prompt_tokens


def sentence(seed, i, n=8):
    return f"S{seed}x{i} " + " ".join(f"w{seed}x{i}x{j}" for j in range(n - 1)) + "."


def text(seed, sentences, n=8):
    return " ".join(sentence(seed, i, n) for i in range(sentences))


def hits_of(*chunks):
    return [SearchHit(c, 1 - r / 10) for r, c in enumerate(chunks)]


def context(hits, question, budget, tokenizer=MINILM, selector=Selector(), lead=()):
    # Hits given: rag_context searches nothing, so the collection is only "not None".
    return rag_context(object(), question, budget, tokenizer, k=len(hits), lead=lead, hits=hits, selector=selector)


def in_document_order(piece_texts, original):
    at = 0
    for piece in piece_texts:
        found = original.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True


def test_the_sentence_with_the_questions_words_is_chosen():
    facts = Chunk("tower", 0, "The park opened in spring. The Blue Tower stands 324 metres tall. "
                              "Its lift carries visitors to the top. Tickets are sold at the gate.", "Paris")
    other = Chunk("river", 2, "Boats sail down the river at noon. The bridge was painted green.", "Rivers")
    question = "How tall is the Blue Tower?"
    budget = prompt_tokens(MINILM, question, [Chunk("tower", 0, "The Blue Tower stands 324 metres tall.", "Paris")])
    ctx = context(hits_of(other, facts), question, budget + 2)
    assert [c.text for c in ctx.trimmed.chunks] == ["The Blue Tower stands 324 metres tall."]
    assert [p.hit.chunk for p in ctx.citations] == [facts]  # cited as the whole chunk it came from
    # Whole chunks: the first hit fills the same budget, and the answer is not in it.
    assert "324" not in context(hits_of(other, facts), question, budget + 2, selector=None).messages[0]["content"]


def test_clauses_of_a_long_sentence_fit_where_the_sentence_does_not():
    long = Chunk("d", 0, "Before the war, in a cold winter, the Blue Tower was built by Ada Lovelace, who drew it "
                         "on paper, with ink, over many nights.")
    question = "Who built the Blue Tower?"
    budget = prompt_tokens(Words(), question, [Chunk("d", 0, "the Blue Tower was built by Ada Lovelace,")])
    [piece] = context(hits_of(long), question, budget, Words()).trimmed.chunks
    assert "the Blue Tower was built by Ada Lovelace," in piece.text and len(piece.text) < len(long.text)
    assert not context(hits_of(long), question, budget, Words(), Selector(grain="sentence")).trimmed.chunks


def test_non_adjacent_pieces_are_joined_with_a_gap_in_document_order():
    chunk = Chunk("d", 0, "Alpha one here. Filler two. Filler three. Filler four. Beta five here.")
    question = "alpha beta?"
    picked = [Chunk("d", 0, f"Alpha one here.{GAP}Beta five here.")]
    [piece] = context(hits_of(chunk), question, prompt_tokens(Words(), question, picked), Words()).trimmed.chunks
    assert piece.text == picked[0].text and piece.id == chunk.id


def test_a_budget_that_holds_everything_gives_whole_chunks():
    chunks = [Chunk("a", 0, text(1, 4)), Chunk("b", 3, text(2, 3), "B"), Chunk("c", 1, sentence(3, 0))]
    question = "S1x2 w2x1x3?"
    hits = hits_of(*chunks)
    assert context(hits, question, 10_000).trimmed == context(hits, question, 10_000, selector=None).trimmed


def test_without_a_selector_the_context_is_todays():
    chunks = [Chunk("a", 0, text(1, 4)), Chunk("b", 3, text(2, 3), "B"), Chunk("c", 1, text(3, 2))]
    question, hits = "S1x2 w2x1x3?", hits_of(*chunks)
    for budget in (100, 150, 400):
        ctx = context(hits, question, budget, selector=None)
        today = trim(chunks, question, budget, MINILM)
        assert ctx.trimmed == today and ctx.messages == build_prompt(question, today.chunks).messages


def test_edge_cases():
    question = "What about w9x0x1?"
    assert context([], question, 200).trimmed.chunks == []
    # No word in common: the best hit's first sentences, as far as they fit.
    first, second = Chunk("a", 0, text(1, 6)), Chunk("b", 0, text(2, 6))
    [kept] = context(hits_of(first, second), "Why?", 80, Words()).trimmed.chunks
    assert kept.id == first.id and first.text.startswith(kept.text)
    # A one-sentence chunk is kept whole or not at all; overlapping chunks give a shared sentence once.
    one, a, b = Chunk("x", 0, sentence(9, 0)), Chunk("y", 0, text(8, 3)), Chunk("y", 1, sentence(8, 2))
    assert context(hits_of(one, a, b), question, 10_000, Words()).trimmed.chunks == [one, a]
    with pytest.raises(RetrievalError, match="smaller than the prompt"):
        context(hits_of(one), question, 5, Words())
    with pytest.raises(RetrievalError, match="grain"):
        Selector(grain="word")


def test_the_lead_passes_untouched_and_first():
    chunks = [Chunk("a", 0, text(1, 5)), Chunk("b", 1, text(2, 5)), Chunk("c", 0, text(3, 5))]
    question, hits = "S2x1 w2x1x2 S3x4?", hits_of(*chunks)
    narrow = context(hits, question, 120)
    assert narrow.trimmed.chunks and all(c.text != w.text for c in narrow.trimmed.chunks for w in chunks)
    wide = context(hits, question, 400, lead=narrow.trimmed.chunks)
    assert wide.trimmed.chunks[:len(narrow.trimmed.chunks)] == narrow.trimmed.chunks
    assert wide.messages[0]["content"].startswith(narrow.messages[0]["content"])
    assert wide.trimmed.tokens <= 400


HITS = st.lists(
    st.builds(Chunk, doc_id=st.sampled_from(["a", "b", "doc-7", "Zed"]), position=st.integers(0, 6),
              text=st.builds(text, st.integers(0, 10**6), st.integers(1, 8), st.integers(1, 30)),
              title=st.sampled_from(["", "Title", "A longer title here"])),
    max_size=12, unique_by=lambda c: c.id).map(lambda chunks: hits_of(*chunks))


@settings(max_examples=150, deadline=None)
@given(hits=HITS, budget=st.integers(0, 1500), tokenizer=st.sampled_from(TOKENIZERS), data=st.data())
def test_budget_is_never_exceeded_and_pieces_keep_their_chunk(hits, budget, tokenizer, data):
    # Some of the question's words come from the hits, so the scores differ.
    words = [w for h in hits for w in h.chunk.text.split()]
    question = " ".join(data.draw(st.lists(st.sampled_from(words), max_size=6)) if words else []) + " why?"
    if budget < prompt_tokens(tokenizer, question, []):
        with pytest.raises(RetrievalError):
            context(hits, question, budget, tokenizer)
        return
    ctx = context(hits, question, budget, tokenizer)
    assert ctx.trimmed.tokens == prompt_tokens(tokenizer, question, ctx.trimmed.chunks) <= budget
    originals = {h.chunk.id: h.chunk for h in hits}
    for c in ctx.trimmed.chunks:
        whole = originals[c.id]
        assert (c.doc_id, c.position, c.title) == (whole.doc_id, whole.position, whole.title)
        assert in_document_order(c.text.split(GAP), whole.text)
    assert [p.hit.chunk.id for p in ctx.citations] == [c.id for c in ctx.trimmed.chunks]


def test_an_answer_cites_by_number_else_the_passage_it_quotes():
    texts = ["Deadlines: a request past its deadline gets a 504.",
             "Disconnects: a client that goes away cancels its generation; the engine frees its KV blocks."]
    passages = [Passage(i + 1, SearchHit(Chunk("gateway.md", i, t), 1.0)) for i, t in enumerate(texts)]
    ctx = RagContext([], passages, [], TrimResult([], [], 0, 0))
    assert ctx.cited("It gets a 504 [1], see [7].") == [1]       # [7] is no passage
    # No number: the passage that holds most of the answer's words, at least half of them.
    assert ctx.cited("The client cancels its generation and the engine frees its KV blocks.") == [2]
    assert ctx.cited("I do not know.") == []
    assert RagContext([], [], [], ctx.trimmed).cited("anything") == []
