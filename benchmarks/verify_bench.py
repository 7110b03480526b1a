"""What speculation has to beat, step by step: the time of one target step that verifies k
drafted tokens against a plain decode step (k = 0), at a RAG-sized and a GSM8K-sized context,
for one sequence and for four, and the draft model's decode step against the target's. These
are the ratios the cost model (engine/speculative.py best_k) and the governor work with.

Steps are timed through the model runner on sequences already prefilled, each case repeated
in turns (case A, B, C, A, B, C, ...) so a load change on the machine hits every case alike;
medians. Prints a table and writes benchmarks/results/verify_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from common import RESULTS, machine
from rich.console import Console
from rich.table import Table

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step import ScheduledSeq, SchedulerOutput

console = Console()


def prefilled(e: LLMEngine, model: str, context: int, n: int) -> list:
    """n sequences of `context` tokens whose KV is computed, ready to decode."""
    worker = e.worker(model)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    ids = {e.add_request([(7 * i + j) % 5000 + 100 for j in range(context)], params, model) for i in range(n)}
    while any(s.in_prefill or s.num_computed_tokens == 0 for s in worker.scheduler.running) \
            or worker.scheduler.waiting:
        e.step()
    return [s for s in worker.scheduler.running if s.request_id in ids]     # not the earlier cases' ones


def step_case(e: LLMEngine, model: str, seqs: list, k: int):
    """A closure running one step that verifies k dummy draft tokens per sequence."""
    worker = e.worker(model)

    def run() -> None:
        items = []
        for seq in seqs:
            worker.block_manager.resize(seq, len(seq) + k)
            items.append(ScheduledSeq(seq, seq.num_computed_tokens, 1 + k, True,
                                      draft=[seq.token_ids[-1]] * k))      # verified past the sequence's end
        worker.runner.run(SchedulerOutput(items))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="int8", choices=["none", "int8", "int4"])
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 6])
    args = ap.parse_args()
    e = LLMEngine(EngineConfig(models={"large": ModelEntry("qwen2.5-coder-1.5b", quant=args.quant),
                                       "small": ModelEntry("qwen2.5-coder-0.5b", quant=args.quant)},
                               max_kv_blocks=512, prefix_caching=False), progress=False)
    cases = {}
    for context in (400, 100):          # a SQuAD passage prompt; a GSM8K problem
        for batch in (1, 4):
            seqs = prefilled(e, "large", context, batch)
            for k in args.ks:
                cases[("large", context, batch, k)] = step_case(e, "large", seqs, k)
        cases[("small", context, 1, 0)] = step_case(e, "small", prefilled(e, "small", context, 1), 0)
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):
        for case, run in cases.items():
            start = time.perf_counter()
            run()
            times[case].append(time.perf_counter() - start)
    med = {c: statistics.median(t[1:]) for c, t in times.items()}    # the first turn warms up
    rows = []
    table = Table(title=f"Verification cost, {args.quant} weights (median of {args.repeats - 1} turns)")
    for col in ("context", "batch", "k", "step ms", "vs plain step", "extra per draft token", "break-even tokens/pass"):
        table.add_column(col, justify="right")
    for (model, context, batch, k), t in med.items():
        if model != "large":
            continue
        plain = med[("large", context, batch, 0)]
        ratio = t / plain
        rows.append({"context": context, "batch": batch, "k": k, "step_s": t, "vs_plain": ratio,
                     "extra_per_token": (ratio - 1) / k if k else None})
        # A verify pass pays when it yields more tokens than its cost in plain steps.
        table.add_row(str(context), str(batch), str(k), f"{t * 1000:.1f}", f"{ratio:.2f}x",
                      f"{(ratio - 1) / k:.3f}" if k else "", f"{ratio:.2f}" if k else "")
    draft = [{"context": c, "draft_step_s": med[("small", c, 1, 0)], "target_step_s": med[("large", c, 1, 0)],
              "ratio": med[("small", c, 1, 0)] / med[("large", c, 1, 0)]} for c in (400, 100)]
    console.print(table)
    for d in draft:
        console.print(f"context {d['context']}: 0.5B decode step {d['draft_step_s'] * 1000:.1f} ms, 1.5B "
                      f"{d['target_step_s'] * 1000:.1f} ms: draft/target **{d['ratio']:.2f}**")
    out = RESULTS / "verify_bench.json"
    out.write_text(json.dumps({"machine": machine(), "quant": args.quant, "repeats": args.repeats,
                               "rows": rows, "draft_vs_target": draft}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
