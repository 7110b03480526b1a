"""Speculative decoding on the Qwen pair, as the server runs it: the large model's decode
tokens/s under each speculation configuration against speculation off, on two workloads (RAG
answers to SQuAD questions from their passage; GSM8K solutions), at batch 1 and 4.

Every run starts cold, as a fresh server would: a new speculator (no measured costs, no
answer lengths, a governor that has decided nothing) and an empty draft-model prefix cache,
so the ratios count the warm-up. The target's prefix cache is kept (its prefill is the same
in every configuration and is not decode time). The first quarter of each run's prompts is
also reported on its own (warm-up). For each workload and batch size the configurations run
back to back, `--repeats` times in a rotated order; the table shows the median ratio.
Outputs are checked identical to plain greedy decoding.
Then escalation: verifying the small model's whole answer as an external draft against
generating the large answer from scratch.
Prints a table and writes benchmarks/results/spec_bench.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from pathlib import Path

import msgspec
from common import RESULTS, ROOT, machine
from rich.console import Console
from rich.progress import track
from rich.table import Table

from engine.config import EngineConfig, SpecConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import Speculator
from gateway.config import default_engine
from retrieval import Chunk, build_prompt

console = Console(width=150)
DEFAULT = default_engine().speculative           # what `sluice serve` runs
CONFIGS = {"off": None,
           "off, again": None,         # against "off": how far the machine alone moves a ratio
           "default": DEFAULT,
           "default, no governor": msgspec.structs.replace(DEFAULT, govern=False),
           "draft model": SpecConfig(DEFAULT.target, DEFAULT.draft, prompt_lookup=False, govern=False),
           "draft model, whole vocabulary": SpecConfig(DEFAULT.target, DEFAULT.draft, prompt_lookup=False,
                                                       govern=False, draft_vocab=0),
           "prompt lookup": SpecConfig(DEFAULT.target, None, prompt_lookup=True, govern=False)}


def workloads(data: Path, n: int) -> dict[str, list[list[dict]]]:
    rng = random.Random(0)
    articles = json.loads((data / "squad-v1.1-dev-part-a.json").read_text())["data"]
    paras = [p for a in articles for p in a["paragraphs"]]
    rag = [build_prompt(p["qas"][0]["question"], [Chunk("doc", 0, p["context"])]).messages
           for p in rng.sample(paras, n)]
    gsm = [json.loads(line) for line in (data / "gsm8k-train.jsonl").read_text().splitlines()[:500]]
    math = [[{"role": "user", "content": g["question"] + "\nSolve it step by step."}] for g in rng.sample(gsm, n)]
    return {"rag": rag, "gsm8k": math}


def cold(e: LLMEngine, spec: SpecConfig | None) -> None:
    """Speculation as a fresh server starts it."""
    e.speculator = spec and Speculator(spec, e.workers[spec.target], e.workers.get(spec.draft))
    e.worker("small").block_manager.reset_cache()


def run(e: LLMEngine, prompts: list[list[int]], batch: int, params: SamplingParams) -> dict:
    """Decode tokens and seconds (after each batch's first token) per batch of prompts."""
    tokens, seconds, outs, logprobs = [], [], [], []
    for i in range(0, len(prompts), batch):
        start = time.perf_counter()
        done = e.generate(prompts[i:i + batch], params, model="large")
        wall = time.perf_counter() - start
        tokens.append(sum(len(c.token_ids) - 1 for c in done))
        seconds.append(wall - max(c.ttft for c in done))
        outs += [c.token_ids for c in done]
        logprobs += [c.logprobs for c in done]
    stats = e.stats()["large"].get("speculation") or {}
    costs = e.speculator and {name: round(getattr(e.speculator, name), 4)
                              for name in ("draft_cost", "verify_cost", "draft_prefill_cost")}
    return {"tokens": tokens, "seconds": seconds, "outputs": outs, "logprobs": logprobs, "costs": costs,
            "acceptance": stats.get("acceptance_rate"),
            "tokens_per_verify_pass": stats.get("tokens_per_verify_pass"),
            "by_source": stats.get("by_source"), "governor": stats.get("governor")}


def divergences(r: dict, plain: dict) -> list[dict]:
    """Where an output leaves plain greedy decoding's, with both runs' probability of the token
    each chose there: a verification pass computes k + 1 rows at once, whose rounding differs
    from one row's, and flips near-ties (two tokens at about the same probability)."""
    out = []
    for i, (a, b) in enumerate(zip(plain["outputs"], r["outputs"])):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            p = lambda run, j: round(math.exp(run["logprobs"][i][j]), 4) if j < len(run["logprobs"][i]) else None
            out.append({"prompt": i, "at": at, "plain_token": a[at:at + 1], "spec_token": b[at:at + 1],
                        "plain_p": p(plain, at), "spec_p": p(r, at)})
    return out


def rate(r: dict, part: slice = slice(None)) -> float:
    return sum(r["tokens"][part]) / sum(r["seconds"][part])


def identical(row: dict) -> str:
    """"yes", or how many outputs differ and the probabilities plain and speculative decoding
    gave their two tokens where they part."""
    ds = [d for run in row["divergences"] for d in run]
    return "yes" if not ds else f"{len(ds)} differ: " + ", ".join(f"p {d['plain_p']}/{d['spec_p']}" for d in ds[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32, help="per workload")
    ap.add_argument("--tokens", type=int, default=32, help="most tokens per answer (RAG answers stop by themselves)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--single-source-batches", nargs="+", type=int, default=[1],
                    help="batch sizes at which the one-source configurations run (the targets are at batch 1)")
    ap.add_argument("--workloads", nargs="+", default=["rag", "gsm8k"], choices=["rag", "gsm8k"])
    ap.add_argument("--escalation", type=int, default=4, help="RAG prompts for the external-draft measurement")
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("SLUICE_DATA", ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", type=Path, default=RESULTS / "spec_bench.json")
    args = ap.parse_args()
    configs = ["off"] + [c for c in args.configs if c != "off"]
    models = default_engine().models
    e = LLMEngine(EngineConfig(models=models, max_kv_blocks=2048, speculative=DEFAULT), progress=False)
    loads = {name: [e.prompter("large").chat(c) for c in convs]
             for name, convs in workloads(args.data, args.prompts).items() if name in args.workloads}
    params = SamplingParams(max_tokens=args.tokens)
    warm = max(1, args.prompts // 4)                 # prompts counted as warm-up
    single = ("off, again", "draft model", "draft model, whole vocabulary", "prompt lookup")
    # A configuration runs minutes, not half an hour, from the "off" it is compared with (this
    # machine's speed drifts by 1.5x within a run), in an order rotated every repeat.
    cells = [(w, b, c) for r in range(args.repeats) for w in loads for b in args.batches
             for c in configs[r % len(configs):] + configs[:r % len(configs)]
             if c not in single or b in args.single_source_batches]
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for name, batch, config in track(cells, description="spec_bench", console=console):
        cold(e, CONFIGS[config])
        r = run(e, loads[name], batch, params)
        runs.setdefault((name, batch, config), []).append(r)
        console.print(f"{name} b{batch} {config}: {rate(r):.2f} tok/s, acceptance {r['acceptance']}, "
                      f"governor {r['governor']}")
    rows = []
    for (name, batch, config), rs in runs.items():
        offs = runs[(name, batch, "off")]
        w = warm // batch                              # batches in the warm-up
        ratios = [rate(r) / rate(o) for r, o in zip(rs, offs)]
        warm_ratios = [rate(r, slice(0, max(w, 1))) / rate(o, slice(0, max(w, 1))) for r, o in zip(rs, offs)]
        rows.append({"workload": name, "batch": batch, "config": config,
                     "tok_s": [rate(r) for r in rs], "ratio_median": statistics.median(ratios), "ratios": ratios,
                     "warmup_ratio_median": statistics.median(warm_ratios),
                     "steady_ratio_median": statistics.median(rate(r, slice(w, None)) / rate(o, slice(w, None))
                                                              for r, o in zip(rs, offs)),
                     "identical_to_plain": all(r["outputs"] == o["outputs"] for r, o in zip(rs, offs)),
                     "divergences": [divergences(r, o) for r, o in zip(rs, offs)],
                     "costs": [r["costs"] for r in rs],
                     "acceptance": [r["acceptance"] for r in rs], "by_source": rs[-1]["by_source"],
                     "governor": rs[-1]["governor"],
                     "tokens_per_verify_pass": [r["tokens_per_verify_pass"] for r in rs]})
    # Escalation: the small model's answer handed to the large one as an external draft.
    cold(e, CONFIGS["prompt lookup"])
    escalation = []
    for prompt in loads.get("rag", [])[:args.escalation]:
        small = e.generate([prompt], params, model="small")[0]
        t0 = time.perf_counter()
        scratch = e.generate([prompt], params, model="large", salt=b"scratch")[0]
        t1 = time.perf_counter()
        rid = e.add_request(prompt, params, model="large", draft=small.token_ids, salt=b"drafted")
        done = None
        while done is None:
            done = next((o.completion for o in e.step() if o.request_id == rid and o.completion), None)
        t2 = time.perf_counter()
        escalation.append({"scratch_s": t1 - t0, "with_draft_s": t2 - t1,
                           "identical": done.token_ids == scratch.token_ids,
                           "small_agrees": small.token_ids == scratch.token_ids})
    table = Table(title=f"Speculative decoding, {models['large'].source} {models['large'].quant} target, "
                        f"{models['small'].source} {models['small'].quant} draft: decode tok/s against "
                        f"speculation off, median of {args.repeats} cold runs of {args.prompts} prompts "
                        f"(at most {args.tokens} greedy tokens)")
    for col in ("workload", "batch", "config", "tok/s", "vs off", f"warm-up ({warm} prompts)", "after", "acceptance",
                "identical"):
        table.add_column(col)
    for r in rows:
        acc = [a for a in r["acceptance"] if a is not None]
        table.add_row(r["workload"], str(r["batch"]), r["config"], f"{statistics.median(r['tok_s']):.2f}",
                      f"{r['ratio_median']:.2f}x", f"{r['warmup_ratio_median']:.2f}x",
                      f"{r['steady_ratio_median']:.2f}x", f"{statistics.median(acc):.2f}" if acc else "-", identical(r))
    console.print(table)
    if escalation:
        scratch_s = sum(x["scratch_s"] for x in escalation)
        drafted_s = sum(x["with_draft_s"] for x in escalation)
        console.print(f"escalation: large from scratch {scratch_s:.1f}s, verifying the small model's answer "
                      f"{drafted_s:.1f}s ({scratch_s / drafted_s:.2f}x), outputs identical: "
                      f"{all(x['identical'] for x in escalation)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(),
                                    "models": {k: msgspec.to_builtins(v) for k, v in models.items()},
                                    "default_speculation": msgspec.to_builtins(DEFAULT), "tokens": args.tokens,
                                    "prompts": args.prompts, "repeats": args.repeats, "warmup_prompts": warm,
                                    "rows": rows, "escalation": escalation}, indent=2))


if __name__ == "__main__":
    main()
