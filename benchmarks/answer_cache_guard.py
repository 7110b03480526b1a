"""The answer cache's near-duplicate rule, on questions that must not match and on rewordings
that should.

A near hit needs three things: the question's embedding within the tenant's similarity of
a cached question's, the same passages retrieved, and the guard (pipeline/answer_guard.py).
Here the passages are taken to be the same for every pair (the worst case: SQuAD's questions
about one paragraph do retrieve it), so the embedding and the guard decide alone. A wrong hit
needs both, so the guard judges every pair and the embedding is computed for every pair the
guard lets through (exact counts); how often the embedding alone would have matched is
measured on a random sample of each kind's pairs (--sample), to keep the embedding to a few
thousand questions on 2 cores.

Must not match:
  * every pair of different questions about the same SQuAD paragraph (dev half), different
    after normalization (a pair equal after it is the same question, an exact hit);
  * each question with a negation put in ("What is ..." -> "What is not ...");
  * each question with a number changed (1998 -> 1999, three -> four);
  * each question with a comparative or superlative turned (most <-> least, before <-> after).
Should match (reworded repeats, made from each question): asked politely ("Can you tell me
...?"), as an embedded question (the auxiliary moved: "tell me what the capital of France
is"), with "please", with a contraction ("what's"), without articles. And, as a control
the guard is meant to refuse, a synonym ("What" -> "Which").

    .venv/bin/python benchmarks/answer_cache_guard.py [--squad PATH] [--thresholds 0.8 0.85 0.9 0.95]
Prints a table; writes benchmarks/results/answer_cache_guard.json.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
from common import ROOT, machine, write_results

from pipeline.answer_cache import CacheTerms, normalize
from pipeline.answer_guard import AUXILIARIES, blocked, signature

SQUAD = Path("/work/shared/data/squad-v1.1-dev-part-a.json")
NUMBER_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
TURNS = {"most": "least", "least": "most", "more": "less", "less": "more", "largest": "smallest",
         "smallest": "largest", "first": "last", "last": "first", "before": "after", "after": "before",
         "highest": "lowest", "lowest": "highest", "biggest": "smallest", "earliest": "latest", "latest": "earliest",
         "longest": "shortest", "shortest": "longest", "best": "worst", "worst": "best", "larger": "smaller",
         "smaller": "larger", "higher": "lower", "lower": "higher", "older": "younger", "oldest": "youngest"}
AUX = re.compile(r"\b(" + "|".join(sorted(AUXILIARIES, key=len, reverse=True)) + r")\b", re.I)


def paragraphs(path: Path) -> list[list[tuple[str, set[str]]]]:
    """Per paragraph: (question, its normalized gold answers)."""
    data = json.loads(path.read_text())["data"]
    return [[(qa["question"].strip(), {normalize(a["text"]) for a in qa["answers"]}) for qa in p["qas"]]
            for article in data for p in article["paragraphs"]]


def negated(q: str) -> str | None:
    m = AUX.search(q)
    return None if m is None else f"{q[:m.end()]} not{q[m.end():]}"


def renumbered(q: str) -> str | None:
    m = re.search(r"\d+", q)
    if m:
        return f"{q[:m.start()]}{int(m.group()) + 1}{q[m.end():]}"
    for i, w in enumerate(NUMBER_WORDS[:-1]):
        m = re.search(rf"\b{w}\b", q, re.I)
        if m:
            return f"{q[:m.start()]}{NUMBER_WORDS[i + 1]}{q[m.end():]}"
    return None


def turned(q: str) -> str | None:
    m = re.search(r"\b(" + "|".join(TURNS) + r")\b", q, re.I)
    return None if m is None else f"{q[:m.start()]}{TURNS[m.group().lower()]}{q[m.end():]}"


def bare(q: str) -> str:
    return q.rstrip(" ?")


def lower_first(q: str) -> str:
    """The question as the rest of a sentence: its first letter lowered unless it starts a name."""
    first = q.split(" ", 1)[0]
    return q if first[1:2].isupper() or first.lower() not in {"what", "who", "when", "where", "which", "why", "how",
                                                                "in", "on", "at", "for", "from", "to", "by", "during",
                                                                "is", "are", "was", "were", "did", "does", "do"} \
        else q[:1].lower() + q[1:]


def embedded(q: str) -> str | None:
    """An embedded question: the first auxiliary after the question word moved to the end."""
    m = AUX.search(q)
    if m is None or m.start() == 0:
        return None
    rest = f"{q[:m.start()].rstrip()} {q[m.end():].strip()}".rstrip(" ?")
    return f"Tell me {lower_first(rest)} {m.group().lower()}."


REWORDINGS = {
    "polite": lambda q: f"Can you tell me {lower_first(bare(q))}?",
    "embedded": embedded,
    "please": lambda q: f"{bare(q)}, please?",
    "contraction": lambda q: (re.sub(r"\b(What|Who|Where|When|How|what|who|where|when|how) is\b", r"\1's", q)
                              if re.search(r"\b(what|who|where|when|how) is\b", q, re.I) else None),
    "no_articles": lambda q: (re.sub(r"\s+", " ", re.sub(r"\b(the|a|an|The|A|An)\b", "", q)).strip()
                              if re.search(r"\b(the|a|an)\b", q, re.I) else None),
    "synonym (control)": lambda q: re.sub(r"^What\b", "Which", q) if q.startswith("What ") else None,
}
FRAMING = [k for k in REWORDINGS if "control" not in k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--squad", type=Path, default=SQUAD)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.8, 0.85, 0.9, 0.95])
    ap.add_argument("--sample", type=int, default=400, help="pairs per kind for the embedding-alone rates")
    ap.add_argument("--reworded", type=int, default=300, help="questions reworded each way")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "answer_cache_guard.json")
    args = ap.parse_args()
    default = CacheTerms().similarity
    thresholds = sorted({*args.thresholds, default})

    paras = paragraphs(args.squad)
    must_not: dict[str, list[tuple[str, str, bool]]] = {k: [] for k in ("same paragraph", "negation", "number",
                                                                       "comparative")}
    duplicates = 0
    for p in paras:
        for i, (a, gold_a) in enumerate(p):
            for b, gold_b in p[i + 1:]:
                if normalize(a) == normalize(b):
                    duplicates += 1
                else:                     # the third field: the two have no gold answer in common
                    must_not["same paragraph"].append((a, b, not gold_a & gold_b))
    questions = [q for p in paras for q, _ in p]
    for kind, flip in (("negation", negated), ("number", renumbered), ("comparative", turned)):
        must_not[kind] = [(q, f, True) for q in questions
                          if (f := flip(q)) is not None and normalize(f) != normalize(q)]
    rng = random.Random(args.seed)
    asked = rng.sample(questions, min(args.reworded, len(questions)))
    should = {kind: [(q, r) for q in asked if (r := make(q)) is not None and r != q]
              for kind, make in REWORDINGS.items()}
    sigs = {t: signature(t) for pairs in must_not.values() for a, b, _ in pairs for t in (a, b)}
    sigs |= {t: signature(t) for pairs in should.values() for a, b in pairs for t in (a, b)}
    sampled = {kind: rng.sample(pairs, min(args.sample, len(pairs))) for kind, pairs in must_not.items()}
    passing = {kind: [p for p in pairs if blocked(sigs[p[0]], sigs[p[1]]) is None] for kind, pairs in must_not.items()}
    texts = sorted({t for pairs in (*sampled.values(), *passing.values()) for a, b, _ in pairs for t in (a, b)} |
                   {t for pairs in should.values() for a, b in pairs for t in (a, b)})
    from tqdm import tqdm

    from retrieval import Embedder
    embedder = Embedder(device="cpu", batch_size=256)
    start = time.perf_counter()
    vectors = np.concatenate([embedder.encode(texts[i:i + 256])
                              for i in tqdm(range(0, len(texts), 256), desc="embedding", unit="batch")])
    embed_s = time.perf_counter() - start
    index = {t: i for i, t in enumerate(texts)}
    similarity = lambda a, b: float(vectors[index[a]] @ vectors[index[b]])

    results: dict = {"machine": machine(), "squad": args.squad.name, "default_similarity": default,
                     "texts_embedded": len(texts), "embed_s": round(embed_s, 1),
                     "same_normalized_question_pairs_left_out": duplicates, "must_not_match": {}, "rewordings": {}}
    print(f"{len(texts)} texts embedded in {embed_s:.0f} s\n")
    print(f"{'must not match':<16}{'pairs':>8}{'guard passes':>14}" +
          "".join(f"{f'emb>={t}':>11}" for t in thresholds) + "".join(f"{f'wrong@{t}':>11}" for t in thresholds))
    total = {t: 0 for t in thresholds}
    for kind, pairs in must_not.items():
        alone = np.array([similarity(a, b) for a, b, _ in sampled[kind]])       # the embedding alone, sampled
        sims = np.array([similarity(a, b) for a, b, _ in passing[kind]])        # every pair the guard passes
        reasons = Counter(blocked(sigs[a], sigs[b]) or "passed" for a, b, _ in pairs)
        wrong = {t: int((sims >= t).sum()) for t in thresholds}
        differ = np.array([d for _, _, d in passing[kind]], bool)
        examples = [(a, b, round(float(s), 3)) for (a, b, _), s in zip(passing[kind], sims)][:10]
        results["must_not_match"][kind] = {
            "pairs": len(pairs), "guard_passes": len(passing[kind]),
            "embedding_alone_over_share": {str(t): round(float((alone >= t).mean()), 4) for t in thresholds},
            "embedding_alone_sample": len(alone),
            "wrong_hits": {str(t): wrong[t] for t in thresholds},
            "wrong_hits_with_different_gold_answers": {str(t): int(((sims >= t) & differ).sum()) for t in thresholds},
            "blocked_by": dict(reasons.most_common()),
            "similarity_p50_p99_sampled": [round(float(np.percentile(alone, 50)), 3),
                                           round(float(np.percentile(alone, 99)), 3)],
            "guard_passes_examples": examples}
        for t in thresholds:
            total[t] += wrong[t]
        print(f"{kind:<16}{len(pairs):>8}{len(passing[kind]):>14}" +
              "".join(f"{(alone >= t).mean():>11.1%}" for t in thresholds) +
              "".join(f"{wrong[t]:>11}" for t in thresholds))
    pairs_total = sum(len(p) for p in must_not.values())
    results["must_not_match_total"] = {"pairs": pairs_total, "wrong_hits": {str(t): total[t] for t in thresholds}}
    print(f"{'total':<16}{pairs_total:>8}{'':>14}" + "".join(f"{'':>11}" for _ in thresholds) +
          "".join(f"{total[t]:>11}" for t in thresholds))

    print(f"\n{'reworded repeat':<20}{'pairs':>8}{'guard passes':>14}" +
          "".join(f"{f'hit@{t}':>10}" for t in thresholds))
    hits_all = {t: 0 for t in thresholds}
    framing_pairs = 0
    for kind, pairs in should.items():
        sims = np.array([similarity(a, b) for a, b in pairs])
        passes = np.array([blocked(sigs[a], sigs[b]) is None for a, b in pairs])
        rate = {t: float(((sims >= t) & passes).mean()) for t in thresholds}
        results["rewordings"][kind] = {
            "pairs": len(pairs), "guard_passes": round(float(passes.mean()), 4),
            "hit_rate": {str(t): round(rate[t], 4) for t in thresholds},
            "blocked_by": dict(Counter(blocked(sigs[a], sigs[b]) or "passed" for a, b in pairs).most_common()),
            "examples": [(a, b, round(float(s), 3)) for (a, b), s in list(zip(pairs, sims))[:3]]}
        if kind in FRAMING:
            framing_pairs += len(pairs)
            for t in thresholds:
                hits_all[t] += int(((sims >= t) & passes).sum())
        print(f"{kind:<20}{len(pairs):>8}{passes.mean():>14.3f}" + "".join(f"{rate[t]:>10.3f}" for t in thresholds))
    results["rewordings_framing_total"] = {"pairs": framing_pairs,
                                           "hit_rate": {str(t): round(hits_all[t] / framing_pairs, 4)
                                                        for t in thresholds}}
    print(f"{'framing, all':<20}{framing_pairs:>8}{'':>14}" +
          "".join(f"{hits_all[t] / framing_pairs:>10.3f}" for t in thresholds))
    print(f"\nat the default similarity {default}: {total[default]} wrong hits in {pairs_total} pairs that must not "
          f"match; {hits_all[default] / framing_pairs:.1%} of {framing_pairs} reworded repeats hit")
    write_results(args.out, results)


if __name__ == "__main__":
    main()
