"""The guard on near-duplicate questions: when may a cached answer to one wording answer another?

An embedding puts "how do I turn it on" near "how do I turn it off" (cosine 0.77 with
all-MiniLM) and "what happened in 1998" near "... in 1999" (0.84), and SQuAD's different
questions about one paragraph retrieve the same passages by design. So the embedding and the
passages only propose a match; this guard decides, and it is deliberately narrow. Each
question is read into a `Signature`: the words that flip meaning (negations, numbers,
entities, comparatives and superlatives, question words) and its core, the question with
only its framing taken away: politeness and request phrasing ("can you tell me", "please",
"I'd like to know"), articles, contractions, case and punctuation. Two questions match only
when every part of their signatures is equal, the core's words in the same order ("did A
beat B" is not "did B beat A") but for its auxiliary verbs, which an embedded question moves
("when was it built" asked as "tell me when it was built") and which must match as a
multiset (tense). A different word anywhere else blocks the match, so synonyms and
reorderings are misses, never wrong hits; `blocked` names the first part that differs,
which is what benchmarks/answer_cache_guard.py counts.
"""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

# Request framing that asks for an answer without changing which one: taken from the start
# of a question (longest first), repeatedly ("hi, can you please tell me ...").
OPENERS = sorted([
    "can you tell me", "could you tell me", "would you tell me", "will you tell me", "can you please tell me",
    "could you please tell me", "please tell me", "tell me", "do you know", "does anyone know", "i'd like to know",
    "i would like to know", "i want to know", "i need to know", "i wonder", "i was wondering", "i'm wondering",
    "quick question", "question", "please", "hi", "hello", "hey", "so", "ok", "okay", "and", "also",
], key=len, reverse=True)
CLOSERS = sorted(["please", "thanks", "thank you", "thx", "if you know", "if you can"], key=len, reverse=True)
ARTICLES = frozenset({"a", "an", "the"})
CONTRACTIONS = [(re.compile(p), r) for p, r in [
    (r"\bcan't\b", "can not"), (r"\bcannot\b", "can not"), (r"\bwon't\b", "will not"), (r"\bshan't\b", "shall not"),
    (r"n't\b", " not"), (r"'re\b", " are"), (r"'ve\b", " have"), (r"'ll\b", " will"), (r"'d\b", " would"),
    (r"'m\b", " am"), (r"\b(what|who|where|when|how|why|which|that|there|it|he|she)'s\b", r"\1 is")]]
NEGATIONS = frozenset({"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere", "without",
                       "except", "lack", "lacks", "lacked", "unable", "fail", "fails", "failed", "off"})
NUMBER_WORDS = frozenset({
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty", "thirty", "forty",
    "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "thousand", "million", "billion", "trillion",
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth", "once", "twice",
    "half", "quarter", "dozen", "single", "double", "triple", "both", "all", "any", "every", "each", "some"})
COMPARATIVES = frozenset({
    "more", "less", "fewer", "most", "least", "fewest", "many", "much", "few", "before", "after", "earlier", "later",
    "earliest", "latest", "last", "next", "previous", "prior", "since", "until", "than", "over", "under", "above",
    "below", "between", "up", "down", "on", "in", "out", "into", "from", "to", "increase", "decrease", "rise", "fall",
    "start", "stop", "begin", "end", "open", "close", "enable", "disable", "allow", "deny", "add", "remove",
    "better", "worse", "best", "worst", "same", "different", "only", "also", "too", "very", "enough", "max",
    "maximum", "min", "minimum", "high", "low", "big", "small", "large", "long", "short", "old", "new", "young"})
AUXILIARIES = frozenset({"is", "are", "was", "were", "am", "be", "been", "being", "do", "does", "did", "has", "have",
                         "had", "will", "would", "can", "could", "shall", "should", "may", "might", "must"})
QUESTION_WORDS = frozenset({"who", "whom", "whose", "what", "when", "where", "which", "why", "how", "whether", "if"})
# Words a question starts with that are no names: question words, auxiliaries, articles,
# prepositions, pronouns, request verbs.
OPENING = QUESTION_WORDS | AUXILIARIES | ARTICLES | frozenset({
    "in", "on", "at", "for", "from", "to", "by", "during", "after", "before", "of", "with", "as", "according",
    "since", "under", "over", "along", "about", "between", "through", "into", "upon", "within", "without", "among",
    "besides", "other", "apart", "aside", "this", "that", "these", "those", "there", "it", "he", "she", "they", "we",
    "i", "you", "his", "her", "its", "their", "our", "my", "your", "name", "list", "give", "tell", "describe",
    "explain", "please", "approximately", "roughly", "around", "besides", "not", "no", "one", "some", "most", "many",
    "much", "each", "every", "all", "both", "either", "neither", "while", "although", "because", "once", "prior"})
WORD = re.compile(r"[^\W_]+(?:[.,:/-][^\W_]+)*")


@dataclass(frozen=True)
class Signature:
    negations: tuple[tuple[str, int], ...]
    numbers: tuple[tuple[str, int], ...]
    entities: frozenset[str]
    comparatives: tuple[tuple[str, int], ...]
    question_words: tuple[tuple[str, int], ...]
    auxiliaries: tuple[tuple[str, int], ...]
    core: tuple[str, ...]                   # in order, without articles and auxiliaries


def _counts(words) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(Counter(words).items()))


def _strip(text: str, phrases: list[str], at_start: bool) -> str:
    """Framing phrases off one end of `text` (words only), until none is left there."""
    changed = True
    while changed and text:
        changed = False
        for p in phrases:
            if (text.startswith(p + " ") if at_start else text.endswith(" " + p)) or text == p:
                text = text[len(p):].lstrip() if at_start else text[:-len(p)].rstrip()
                changed = True
                break
    return text


def signature(question: str) -> Signature:
    text = unicodedata.normalize("NFKC", question).replace("\u2019", "'")
    # Entities as written: a capitalised word, or any word with a capital inside (iPhone); the
    # first word is capitalised whatever it is, so there a function word does not count.
    written = WORD.findall(text)
    entities = frozenset(w.casefold() for i, w in enumerate(written) if any(c.isupper() for c in w[1:])
                         or w[:1].isupper() and (i > 0 or w.casefold() not in OPENING))
    low = text.casefold()
    for pattern, repl in CONTRACTIONS:
        low = pattern.sub(repl, low)
    words = WORD.findall(low)
    line = _strip(_strip(" ".join(words), OPENERS, True), CLOSERS, False)
    core = [w for w in line.split() if w not in ARTICLES]
    numbers = [w for w in words if any(c.isdigit() for c in w) or w in NUMBER_WORDS]
    return Signature(_counts(w for w in words if w in NEGATIONS), _counts(numbers), entities,
                     _counts(w for w in words if w in COMPARATIVES or w.endswith("est") and len(w) > 5),
                     _counts(w for w in words if w in QUESTION_WORDS), _counts(w for w in core if w in AUXILIARIES),
                     tuple(w for w in core if w not in AUXILIARIES))


def blocked(a: Signature, b: Signature) -> str | None:
    """Why `b` may not take `a`'s answer (the first part of their signatures that differs), or None."""
    for part in ("negations", "numbers", "entities", "comparatives", "question_words", "auxiliaries", "core"):
        if getattr(a, part) != getattr(b, part):
            return part
    return None
