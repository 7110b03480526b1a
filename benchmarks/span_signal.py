"""Is a narrow answer that is not in its own context a doomed one? For extractive questions
(SQuAD) the right answer is a span of a passage, so an answer from one passage that is not
found in that passage hints that the passage lacks it, and that the whole context would do
better. This measures that signal beside the answer's mean log-probability, on run folders
that answered the same questions at a narrow and at a wide context budget (mode `large`):

- the share of narrow answers (citation marks stripped) found verbatim in the narrow context;
- the ROC AUC of "not found" and of the mean log-probability, for "the narrow answer is
  wrong" and for "the wide answer scores higher";
- F1 against large-only's where the answer was found and where it was not.

The narrow context is rebuilt as the run built it (its collection, search and trim at its
budget, the large model's tokenizer). Writes benchmarks/results/span_signal.json.

    python benchmarks/span_signal.py --pair .cache/evals/train-squad-256 .cache/evals/train-squad \
        --pair .cache/evals/test-60-256 .cache/evals/test-cascade \
        --pair .cache/evals/test-60-seed1-256 .cache/evals/test-60-seed1
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
from common import RESULTS
from rich.console import Console
from rich.table import Table
from sklearn.metrics import roc_auc_score

from engine.tokenizer import Tokenizer
from evals.records import RecordLog
from evals.runner import COLLECTION, RECORDS_FILE, TENANT, read_config
from models.store import resolve
from retrieval import CollectionStore, Embedder, rag_context

CITE = re.compile(r"\s*\[\d+\]")
console = Console()


def found(answer: str, context: str) -> bool:
    text = CITE.sub("", answer).strip().strip(".").lower()
    return bool(text) and text in context.lower()


def auc(label: np.ndarray, score: np.ndarray) -> float | None:
    return float(roc_auc_score(label, score)) if 0 < label.sum() < len(label) else None


def measure(narrow_run: Path, wide_run: Path, embedder) -> dict:
    config = read_config(narrow_run)
    tokenizer = Tokenizer(resolve(config.models["large"]))
    logs = [RecordLog(f / RECORDS_FILE) for f in (narrow_run, wide_run)]
    narrow, wide = ({r.id: r for r in log.of_mode("large")} for log in logs)
    for log in logs:
        log.close()
    ids = sorted(set(narrow) & set(wide))
    collection = CollectionStore(narrow_run / "collections", embedder).collection(TENANT, COLLECTION, create=False)
    try:
        hit = []
        for i in ids:
            ctx = rag_context(collection, narrow[i].question, config.context_budget, tokenizer, config.k)
            hit.append(found(narrow[i].answer, "\n".join(m["content"] for m in ctx.messages)))
    finally:
        collection.close()
    hit = np.array(hit)
    f1n, f1w = (np.array([run[i].score for i in ids]) for run in (narrow, wide))
    wrong, better = f1n < 0.5, f1w > f1n
    lp = np.array([np.mean(narrow[i].calls[0].logprobs) if narrow[i].calls[0].logprobs else 0.0 for i in ids])
    return {"narrow": str(narrow_run), "wide": str(wide_run), "questions": len(ids), "found": float(hit.mean()),
            "auc_not_found": {"narrow_wrong": auc(wrong, ~hit), "wide_better": auc(better, ~hit)},
            "auc_low_logprob": {"narrow_wrong": auc(wrong, -lp), "wide_better": auc(better, -lp)},
            "f1_found": {"narrow": float(f1n[hit].mean()), "wide": float(f1w[hit].mean())} if hit.any() else None,
            "f1_not_found": {"narrow": float(f1n[~hit].mean()), "wide": float(f1w[~hit].mean())}
            if (~hit).any() else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", nargs=2, action="append", required=True, metavar=("NARROW", "WIDE"))
    args = ap.parse_args()
    embedder = Embedder()
    rows = [measure(Path(n), Path(w), embedder) for n, w in args.pair]
    table = Table(title="A narrow answer not found in its own context")
    for col in ("narrow run", "questions", "found", "AUC not found: wrong / wide better",
                "AUC low log-prob: wrong / wide better", "F1 narrow / wide where not found"):
        table.add_column(col)
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    for r in rows:
        nf = r["f1_not_found"] or {"narrow": None, "wide": None}
        table.add_row(Path(r["narrow"]).name, str(r["questions"]), f"{r['found']:.0%}",
                      f"{fmt(r['auc_not_found']['narrow_wrong'])} / {fmt(r['auc_not_found']['wide_better'])}",
                      f"{fmt(r['auc_low_logprob']['narrow_wrong'])} / {fmt(r['auc_low_logprob']['wide_better'])}",
                      f"{fmt(nf['narrow'])} / {fmt(nf['wide'])}")
    console.print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "span_signal.json").write_text(json.dumps(rows, indent=2) + "\n")
    console.print(f"wrote {RESULTS / 'span_signal.json'}")


if __name__ == "__main__":
    main()
