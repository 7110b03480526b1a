"""Is there routing signal in the question? For a labelled SQuAD run (`make router`'s), the ROC
AUC of features a router could compute before either model runs against three labels: the
small model right, the large model right, and "only the large model is right" (gain: the
questions worth its price). 0.5 is no signal. Writes benchmarks/results/feature_signal.json.

    python benchmarks/feature_signal.py .cache/evals/train-squad
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
from common import RESULTS
from rich.console import Console
from rich.progress import track
from rich.table import Table
from sklearn.metrics import roc_auc_score

from evals.runner import build_collection, load_dataset, read_config
from retrieval import Embedder
from router.data import read_labels

WORD = re.compile(r"[a-z0-9]+")
STOP = set("the a an of in on at to for by with from and or is was were are be been what who when where which "
           "why how did do does that this as it its into than then their there".split())


def content_words(text: str) -> set[str]:
    return {w for w in WORD.findall(text.lower()) if w not in STOP}


def overlap(question: set[str], text: str) -> float:
    return len(question & content_words(text)) / max(1, len(question))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a SQuAD run folder with labels.jsonl")
    ap.add_argument("--out", type=Path, default=RESULTS / "feature_signal.json")
    args = ap.parse_args()
    config = read_config(args.folder)
    gold = {qa["id"]: para["context"] for f in config.files for article in json.loads(Path(f).read_text())["data"]
            for para in article["paragraphs"] for qa in para["qas"]}
    labels = [l for l in read_labels(args.folder) if l.id in gold and l.large_correct is not None]
    collection = build_collection(args.folder, load_dataset(config), Embedder(), progress=False)
    rows = []
    try:
        for l in track(labels, description="features"):
            q, context = content_words(l.question), gold[l.id]
            vector = collection.embedder.encode([l.question])
            dense = [h.score for h in collection.search(l.question, 2, "dense", vector)]
            bm25 = [h.score for h in collection.search(l.question, 2, "bm25")]
            hits = collection.search(l.question, config.k, vector=vector)
            rank = next((i for i, h in enumerate(hits) if h.chunk.text in context), len(hits))
            rows.append({"question/paragraph word overlap": overlap(q, context),
                         "the same, best sentence": max(overlap(q, s) for s in re.split(r"(?<=[.!?])\s+", context)),
                         "top dense score": dense[0], "gap between the top two dense scores": dense[0] - dense[-1],
                         "top BM25 score": bm25[0] if bm25 else 0.0,
                         "gold paragraph ranked first": float(rank == 0),
                         "gold paragraph retrieved": float(rank < len(hits))})
    finally:
        collection.close()
    small = np.array([l.small_correct for l in labels])
    large = np.array([l.large_correct for l in labels])
    targets = {"small right": small, "large right": large, "gain": large & ~small}
    table = Table(title=f"ROC AUC of each feature, {len(labels)} labelled questions ({args.folder.name})")
    for col in ("feature", "mean", *targets):
        table.add_column(col, justify="right")
    result = {}
    for name in rows[0]:
        x = np.array([r[name] for r in rows])
        result[name] = {"mean": round(float(x.mean()), 4)} | {t: round(float(roc_auc_score(y, x)), 4)
                                                              for t, y in targets.items()}
        table.add_row(name, *(f"{v:.3f}" for v in result[name].values()))
    Console(width=140).print(table)
    args.out.write_text(json.dumps({"folder": str(args.folder), "labels": len(labels),
                                    "rates": {t: round(float(y.mean()), 4) for t, y in targets.items()},
                                    "auc": result}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
