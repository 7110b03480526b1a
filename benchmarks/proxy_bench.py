"""What a proxy label costs (evals/lab/proxy.py): the reference answer's log-probability after the
served prompt, for both Qwen models, scored three ways in one run over the same questions:

- off: every token of prompt + reference computed, the LM head over every position (the
  engine's prefix cache off; what a label cost before `score(first=)`);
- on, as sampled: the prefix cache on and the LM head on the reference rows only, questions in
  the run's order;
- on, grouped: the same, in the order `evals proxy` scores them (grouped by the passage a
  prompt opens with, by prompt within a group), so questions whose retrieved passages
  coincide prefill them once.

Prints seconds per question and the largest difference in mean log-probability from "off"
(the paths round differently: int8 layers dequantize for chunks of 64 rows or more), and
writes benchmarks/results/proxy_bench.json.

    python benchmarks/proxy_bench.py --questions 24
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from common import RESULTS, ROOT, machine
from rich.console import Console
from rich.progress import track
from rich.table import Table

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from evals.datasets import files_for
from evals.lab.proxy import ScoreJob, plan_score, score_job, scoring_order
from evals.runner import RunConfig, build_collection, load_dataset, open_run, pipeline_for
from pipeline import default_prices
from retrieval import Embedder

console = Console(width=140)
MODELS = {"small": "qwen2.5-coder-0.5b", "large": "qwen2.5-coder-1.5b"}


def score_before(engine: LLMEngine, job: ScoreJob) -> float:
    """What a label cost before `score(first=)`: every position computed, the head on each."""
    reference = engine.worker(job.model).tokenizer.encode(job.example.answers[0])
    return float(np.mean(engine.score(job.prompt + reference, job.model)[len(job.prompt) - 1:]))


def score_all(engine: LLMEngine, jobs: list[ScoreJob], cached: bool, label: str) -> tuple[float, dict]:
    out = {}
    start = time.perf_counter()
    for job in track(jobs, description=label, console=console):
        out[job.example.id, job.model] = score_job(engine, job)[0].mean_logprob if cached else score_before(engine, job)
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("SLUICE_DATA", ROOT.parent / "shared" / "data")))
    ap.add_argument("--folder", type=Path, default=ROOT / ".cache" / "bench" / "proxy",
                    help="a run folder for the collection (embedded once, kept)")
    ap.add_argument("--out", type=Path, default=RESULTS / "proxy_bench.json")
    args = ap.parse_args()
    # The settings of `make router`'s labels: SQuAD's train half, int8, a 512-token context.
    config = RunConfig("squad", [str(f.resolve()) for f in files_for("squad", None, str(args.data))], 1000, 0,
                       MODELS, default_prices(), 512, 8, 256, 0, "int8", "train", (1, 1))
    open_run(args.folder, config)
    dataset = load_dataset(config)
    collection = build_collection(args.folder, dataset, Embedder())
    engines = {cached: LLMEngine(EngineConfig(models={m: ModelEntry(s, quant="int8") for m, s in MODELS.items()},
                                              memory_budget_gb=6.0, prefix_caching=cached), progress=False)
               for cached in (False, True)}
    try:
        pipeline = pipeline_for(engines[True], config)
        jobs = [plan_score(pipeline, config, e, m, collection)
                for e in dataset.examples[:args.questions] for m in MODELS]
    finally:
        collection.close()
    jobs = [j for j in jobs if j.prompt is not None]
    n = len(jobs) // 2
    runs = {}
    runs["off"] = score_all(engines[False], jobs, False, "off")
    runs["on, as sampled"] = score_all(engines[True], jobs, True, "on, as sampled")
    for w in engines[True].workers.values():
        w.block_manager.reset_cache()
    runs["on, grouped"] = score_all(engines[True], scoring_order(jobs), True, "on, grouped")
    base_s, base = runs["off"]
    rows = []
    table = Table(title=f"Proxy labels: {n} SQuAD train-half questions, both models, int8, context 512, "
                        f"{machine()['isa']}, {machine()['threads']} threads")
    for col in ("scoring", "s / question", "speedup", "max |diff| mean log-prob"):
        table.add_column(col, justify="right")
    for name, (secs, got) in runs.items():
        diff = max(abs(got[k] - base[k]) for k in base)
        rows.append({"scoring": name, "seconds": secs, "s_per_question": secs / n, "speedup": base_s / secs,
                     "max_abs_diff": diff})
        table.add_row(name, f"{secs / n:.2f}", f"{base_s / secs:.2f}x", f"{diff:.4f}")
    console.print(table)
    args.out.write_text(json.dumps({"machine": machine(), "questions": n, "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
