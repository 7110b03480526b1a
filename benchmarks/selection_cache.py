"""What passage selection costs the prefix cache: the share of prompt tokens a prefix cache
serves when several questions ask about the same passages, whole chunks against selection.

Whole chunks in canonical order give questions that retrieve the same chunks a byte-identical
system message, which the engine's prefix cache serves after the first; selection cuts each
question's own sentences out of them, so prompts share less. Workload: the SQuAD dev questions
(part a) grouped by paragraph, as a product's traffic about one document comes together, and
the same questions shuffled. Each prompt is the /v1/ask prompt (hybrid search, top 10, trimmed
to the budget, Qwen2.5's chat template); the cache is the engine's scheme (16-token blocks
keyed by their whole prefix, the least recently used evicted) with room for `--cache-blocks`
(2,048 blocks: 32k tokens, about what the demo server's small model holds), and with room
for everything (the share's upper bound, whatever the order).

    python benchmarks/selection_cache.py [--limit 1000] [--budgets 256 512] [--cache-blocks 2048]
Prints a table; writes benchmarks/results/selection_cache.json.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_results  # noqa: E402
from retrieval_recall import load_squad  # noqa: E402

from engine import EngineConfig, ModelEntry, Prompter  # noqa: E402
from retrieval import CollectionStore, Embedder, Selector, rag_context  # noqa: E402

BLOCK = 16


def cached_share(prompts: list[list[int]], blocks: float = math.inf) -> float:
    """Share of the prompts' tokens in full blocks whose whole prefix an earlier prompt left in
    a cache of `blocks` blocks (least recently used out first)."""
    cache: OrderedDict = OrderedDict()
    cached = total = 0
    for ids in prompts:
        key = ()
        for start in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
            key = hash((key, tuple(ids[start:start + BLOCK])))
            if key in cache:
                cached += BLOCK
                cache.move_to_end(key)
            cache[key] = True
            if len(cache) > blocks:
                cache.popitem(last=False)
        total += len(ids)
    return cached / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.environ.get("SLUICE_DATA", str(Path(__file__).resolve().parents[2] /
                                                                          "shared" / "data")))
    ap.add_argument("--limit", type=int, default=1000, help="questions, whole paragraphs' worth (default 1000)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--cache-blocks", type=int, default=2048)
    args = ap.parse_args()
    docs, questions = load_squad(Path(args.data) / "squad-v1.1-dev-part-a.json")
    questions = questions[:args.limit]            # in the file's order: grouped by paragraph
    prompter = Prompter.load(EngineConfig(models={"m": ModelEntry("qwen2.5-coder-0.5b")}), "m")
    embedder = Embedder()
    methods = {"whole chunks": None, "selection": Selector()}
    prompts: dict[tuple[str, int], list[list[int]]] = {}
    seconds: dict[str, float] = {m: 0.0 for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        collection = CollectionStore(tmp, embedder).collection("bench", "squad")
        for i in tqdm(range(0, len(docs), 32), desc="ingest", unit="batch"):
            collection.ingest(docs[i:i + 32])
        vectors = embedder.encode([q for q, _, _ in questions])
        for (question, _, _), vector in tqdm(zip(questions, vectors), total=len(questions), desc="prompts", unit="q"):
            hits = collection.search(question, 10, vector=vector)
            for name, selector in methods.items():
                for budget in args.budgets:
                    start = time.perf_counter()
                    ctx = rag_context(collection, question, budget, prompter, 10, hits=hits, selector=selector)
                    seconds[name] += time.perf_counter() - start
                    prompts.setdefault((name, budget), []).append(prompter.chat(ctx.messages))
        collection.close()
    order = list(range(len(questions)))
    random.Random(0).shuffle(order)
    rows = []
    for (name, budget), ps in prompts.items():
        shuffled = [ps[i] for i in order]
        rows.append({"method": name, "budget": budget, "unbounded": round(cached_share(ps), 4),
                     "grouped": round(cached_share(ps, args.cache_blocks), 4),
                     "shuffled": round(cached_share(shuffled, args.cache_blocks), 4),
                     "mean_prompt_tokens": round(sum(map(len, ps)) / len(ps), 1)})
    print(f"\n{len(questions)} SQuAD questions over {len({d for _, d, _ in questions})} paragraphs; "
          f"cached share of prompt tokens ({BLOCK}-token blocks; a cache of {args.cache_blocks} blocks)\n")
    print("| context | budget | grouped by paragraph | shuffled | unbounded cache | mean prompt tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['budget']} | {r['grouped']:.3f} | {r['shuffled']:.3f} | {r['unbounded']:.3f} "
              f"| {r['mean_prompt_tokens']} |")
    write_results(RESULTS / "selection_cache.json", {
        "benchmark": "selection_cache", "data": "squad-v1.1-dev-part-a.json", "questions": len(questions),
        "block_tokens": BLOCK, "cache_blocks": args.cache_blocks, "rows": rows,
        "compose_ms_per_question": {m: round(1000 * s / len(questions) / len(args.budgets), 2)
                                    for m, s in seconds.items()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
