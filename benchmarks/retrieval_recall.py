"""Retrieval recall and context-budget survival on SQuAD v1.1 (dev, part a).

Corpus: the 913 paragraphs, one document each. For every question the target is its own
paragraph: recall@k is the share of questions with a chunk of that paragraph among the top k.
Then the top 10 hits are trimmed to 128, 192, 224, 256, 512 and 1,024 tokens of the Qwen2.5 tokenizer
(instructions, passages and question together), and we count how often a gold answer is
still in the prompt: whole chunks, as rag_context trims them without a selector, and each
selection (retrieval/select.py) at 128 to 512 tokens, with the time from the hits to the
trimmed context (selection plus trim; the search that all share is left out).

    python benchmarks/retrieval_recall.py [--data DIR] [--tokenizer DIR] [--limit N]

The data is read from $SLUICE_DATA or ../shared/data; the collection is built in a temporary
folder, so nothing derived from the data lands in the repository except the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from retrieval import CollectionStore, Document, Embedder, Selector, build_prompt, trim  # noqa: E402

SEARCHES = ("dense", "bm25", "hybrid")
RECALL_AT = (1, 3, 5)
WHOLE = "whole chunks"
# 192 and 224 between the narrow arm's 256 and 128: where a selected context's dollars fall to the
# narrow arm's target (selection fills its budget, whole chunks stop short of it).
SELECTED_BUDGETS = (128, 192, 224, 256, 512)
BUDGETS = {WHOLE: SELECTED_BUDGETS + (1024,), "clauses": SELECTED_BUDGETS, "sentences": SELECTED_BUDGETS}
SELECTORS = {WHOLE: None, "clauses": Selector(grain="clause"), "sentences": Selector(grain="sentence")}
TRIM_FROM = 10  # hits handed to trimming


def load_squad(path: Path):
    data = json.loads(path.read_text())["data"]
    docs, questions = [], []
    for a, article in enumerate(data):
        for p, para in enumerate(article["paragraphs"]):
            doc_id = f"{a:02d}-{p:03d}"
            docs.append(Document(doc_id, para["context"], article["title"].replace("_", " ")))
            questions += [(qa["question"], doc_id, [x["text"] for x in qa["answers"]]) for qa in para["qas"]]
    return docs, questions


def answer_tokenizer(folder: str | None):
    """The engine's own tokenizer for Qwen2.5, so counts are the ones the engine will see."""
    from engine.tokenizer import Tokenizer
    from models.store import resolve
    return Tokenizer(Path(folder) if folder else resolve("qwen2.5-coder-0.5b"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.environ.get("SLUICE_DATA", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--tokenizer", help="folder with the answering model's tokenizer.json "
                                        "(default: the model store's qwen2.5-coder-0.5b)")
    ap.add_argument("--limit", type=int, help="only the first N questions (a quick look)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "retrieval_recall.json"))
    args = ap.parse_args()

    docs, questions = load_squad(Path(args.data) / "squad-v1.1-dev-part-a.json")
    questions = questions[:args.limit] if args.limit else questions
    tokenizer = answer_tokenizer(args.tokenizer)
    embedder = Embedder()
    with tempfile.TemporaryDirectory() as tmp:
        collection = CollectionStore(tmp, embedder).collection("bench", "squad")
        t0 = time.perf_counter()
        for i in tqdm(range(0, len(docs), 32), desc="ingest", unit="batch"):
            collection.ingest(docs[i:i + 32])
        ingest_s = time.perf_counter() - t0
        vectors = embedder.encode([q for q, _, _ in questions])

        hits_in = {m: np.zeros(len(RECALL_AT)) for m in SEARCHES}
        kept = {m: {b: 0 for b in budgets} for m, budgets in BUDGETS.items()}
        tokens = {m: {b: [] for b in budgets} for m, budgets in BUDGETS.items()}
        seconds = {m: 0.0 for m in BUDGETS}
        before_trim = 0
        for (question, target, answers), vector in tqdm(zip(questions, vectors), total=len(questions),
                                                        desc="questions", unit="q"):
            for mode in SEARCHES:
                hits = collection.search(question, max(max(RECALL_AT), TRIM_FROM), mode, vector)
                first = next((r for r, h in enumerate(hits) if h.chunk.doc_id == target), None)
                hits_in[mode] += [first is not None and first < k for k in RECALL_AT]
            hits = hits[:TRIM_FROM]  # the last mode: hybrid
            before_trim += any(a in h.chunk.text for a in answers for h in hits)
            for method, selector in SELECTORS.items():
                for budget in BUDGETS[method]:
                    # As rag_context composes it, timed from the hits to the trimmed chunks.
                    t0 = time.perf_counter()
                    chunks = [h.chunk for h in hits] if selector is None else selector.select(
                        question, hits, budget, tokenizer)
                    result = trim(chunks, question, budget, tokenizer)
                    seconds[method] += time.perf_counter() - t0
                    system = build_prompt(question, result.chunks).messages[0]["content"]
                    kept[method][budget] += any(a in system for a in answers)
                    tokens[method][budget].append(result.tokens)

    n = len(questions)
    share = {m: {str(b): round(kept[m][b] / n, 4) for b in BUDGETS[m]} for m in BUDGETS}
    mean_tokens = {m: {str(b): round(float(np.mean(tokens[m][b])), 1) for b in BUDGETS[m]} for m in BUDGETS}
    report = {
        "data": "squad-v1.1-dev-part-a.json", "paragraphs": len(docs), "questions": n,
        "chunks": len(collection), "ingest_seconds": round(ingest_s, 1),
        "recall": {m: {f"@{k}": round(float(v) / n, 4) for k, v in zip(RECALL_AT, hits_in[m])} for m in SEARCHES},
        "answer_in_top_10_hybrid": round(before_trim / n, 4),
        "answer_in_context_after_trim": share[WHOLE],
        "mean_prompt_tokens": mean_tokens[WHOLE],
        "selected": {m: {"answer_in_context": share[m], "mean_prompt_tokens": mean_tokens[m]}
                     for m in SELECTORS if m != WHOLE},
        # Per question and budget, selection (none for whole chunks) plus trim, on this many cores.
        "context_ms_per_question": {m: round(1000 * seconds[m] / n / len(BUDGETS[m]), 2) for m in BUDGETS},
        "cpus": os.cpu_count(),
    }
    print(f"\n{n} questions, {len(docs)} paragraphs, {report['chunks']} chunks\n")
    print("| search | recall@1 | recall@3 | recall@5 |\n|---|---|---|---|")
    for m in SEARCHES:
        print(f"| {m} | " + " | ".join(f"{v:.3f}" for v in report["recall"][m].values()) + " |")
    print(f"\nanswer text in the hybrid top {TRIM_FROM}: {report['answer_in_top_10_hybrid']:.3f}\n")
    widest = BUDGETS[WHOLE]
    print("answer in the context the model reads, by context budget (tokens)\n")
    print("| method | " + " | ".join(map(str, widest)) + " | ms/question |\n|---|" + "---|" * (len(widest) + 1))
    for m in BUDGETS:
        print(f"| {m} | " + " | ".join(f"{share[m][str(b)]:.3f}" if b in BUDGETS[m] else "–" for b in widest)
              + f" | {report['context_ms_per_question'][m]} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
