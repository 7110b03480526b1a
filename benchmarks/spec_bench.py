"""Speculative decoding on the Qwen pair: the large model's decode tokens/s with and without
speculation, per draft source (draft model, prompt lookup, both), at batch 1 and 4, on two
workloads: RAG answers to SQuAD questions with their passage, and GSM8K solutions. Outputs are
checked identical to plain greedy decoding. Then escalation: verifying the small model's whole
answer as an external draft against generating the large answer from scratch.
Prints a table and writes benchmarks/results/spec_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from common import RESULTS, ROOT, machine
from rich.console import Console
from rich.table import Table

from engine.config import EngineConfig, ModelEntry, SpecConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import SpecStats
from retrieval import Chunk, build_prompt

console = Console()
SOURCES = {"off": None, "model": dict(draft="small", prompt_lookup=False),
           "lookup": dict(draft=None, prompt_lookup=True), "both": dict(draft="small", prompt_lookup=True)}


def workloads(data: Path, n: int) -> dict[str, list[list[dict]]]:
    rng = random.Random(0)
    articles = json.loads((data / "squad-v1.1-dev-part-a.json").read_text())["data"]
    paras = [p for a in articles for p in a["paragraphs"]]
    rag = []
    for p in rng.sample(paras, n):
        msgs = build_prompt(p["qas"][0]["question"], [Chunk("doc", 0, p["context"])]).messages
        rag.append(msgs)
    gsm = [json.loads(line) for line in (data / "gsm8k-train.jsonl").read_text().splitlines()[:200]]
    math = [[{"role": "user", "content": g["question"] + "\nSolve it step by step."}] for g in rng.sample(gsm, n)]
    return {"rag": rag, "gsm8k": math}


def engine(source: str, target_quant: str, draft_quant: str, max_k: int | None = None) -> LLMEngine:
    # int8 weights read a quarter of float32's bytes; on this CPU an int8 pass over k+1 tokens
    # also costs little more than over one (benchmarks/gemm_bench.py), which is what verifying
    # a draft needs.
    models = {"large": ModelEntry("qwen2.5-coder-1.5b", quant=target_quant),
              "small": ModelEntry("qwen2.5-coder-0.5b", quant=draft_quant)}
    k = {} if max_k is None else {"max_k": max_k}
    spec = SpecConfig(target="large", **k, **SOURCES[source]) if SOURCES[source] else None
    return LLMEngine(EngineConfig(models=models, max_kv_blocks=1024, speculative=spec), progress=False)


def decode_rate(e: LLMEngine, prompts: list[str], batch: int, n: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of the large model over the prompts, `batch` at a time."""
    params = SamplingParams(max_tokens=n)
    if e.speculator:
        e.speculator.stats = SpecStats()        # acceptance of this run alone
    tokens, seconds, outs = 0, 0.0, []
    for i in range(0, len(prompts), batch):
        start = time.perf_counter()
        done = e.generate(prompts[i:i + batch], params, model="large")
        wall = time.perf_counter() - start
        first = max(c.ttft for c in done)
        tokens += sum(len(c.token_ids) - 1 for c in done)
        seconds += wall - first
        outs += [c.token_ids for c in done]
    return tokens / seconds, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--sources", nargs="+", default=list(SOURCES))
    ap.add_argument("--target-quant", default="int8", choices=["none", "int8", "int4"])
    ap.add_argument("--draft-quant", default="int8", choices=["none", "int8", "int4"])
    ap.add_argument("--max-k", type=int, default=SpecConfig("large").max_k, help="most drafted tokens per pass (SpecConfig.max_k)")
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("SLUICE_DATA", ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", type=Path, default=RESULTS / "spec_bench.json")
    args = ap.parse_args()
    loads = workloads(args.data, args.prompts)
    rows, reference = [], {}
    for source in args.sources:
        e = engine(source, args.target_quant, args.draft_quant, args.max_k)
        for name, convs in loads.items():
            prompts = [e.chat_prompt(c, model="large") for c in convs]
            for batch in (1, 4):
                rate, outs = decode_rate(e, prompts, batch, args.tokens)
                key = (name, batch)
                reference.setdefault(key, outs)
                stats = e.stats()["large"].get("speculation") or {}
                rows.append({"workload": name, "batch": batch, "source": source, "tok_s": rate,
                             "identical_to_plain": outs == reference[key],
                             "acceptance": stats.get("acceptance_rate"),
                             "tokens_per_verify_pass": stats.get("tokens_per_verify_pass")})
                console.print(rows[-1])
    # Escalation: the small model's answer handed to the large one as an external draft.
    e = engine("lookup", args.target_quant, args.draft_quant)
    escalation = []
    for conv in loads["rag"]:
        prompt = e.chat_prompt(conv, model="large")
        small = e.generate([prompt], SamplingParams(max_tokens=args.tokens), model="small")[0]
        t0 = time.perf_counter()
        scratch = e.generate([prompt], SamplingParams(max_tokens=args.tokens), model="large")[0]
        t1 = time.perf_counter()
        rid = e.add_request(prompt, SamplingParams(max_tokens=args.tokens), model="large", draft=small.token_ids)
        done = None
        while done is None:
            done = next((o.completion for o in e.step() if o.request_id == rid and o.completion), None)
        t2 = time.perf_counter()
        escalation.append({"scratch_s": t1 - t0, "with_draft_s": t2 - t1, "identical": done.token_ids == scratch.token_ids,
                           "small_agrees": small.token_ids == scratch.token_ids})
        console.print(escalation[-1])
    table = Table(title=f"Speculative decoding, Qwen2.5-Coder 1.5B {args.target_quant} target, 0.5B "
                        f"{args.draft_quant} draft ({args.tokens} greedy tokens, "
                        f"{args.prompts} prompts per workload)")
    for col in ("workload", "batch", "source", "tok/s", "speedup", "acceptance", "tokens/pass", "identical"):
        table.add_column(col)
    for r in rows:
        base = next(x for x in rows if x["workload"] == r["workload"] and x["batch"] == r["batch"]
                    and x["source"] == "off")
        table.add_row(r["workload"], str(r["batch"]), r["source"], f"{r['tok_s']:.2f}",
                      f"{r['tok_s'] / base['tok_s']:.2f}x",
                      f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-",
                      f"{r['tokens_per_verify_pass']:.2f}" if r["tokens_per_verify_pass"] else "-",
                      str(r["identical_to_plain"]))
    console.print(table)
    scratch = sum(x["scratch_s"] for x in escalation)
    drafted = sum(x["with_draft_s"] for x in escalation)
    console.print(f"escalation: large from scratch {scratch:.1f}s, verifying the small model's answer "
                  f"{drafted:.1f}s ({scratch / drafted:.2f}x), outputs identical: "
                  f"{all(x['identical'] for x in escalation)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "target_quant": args.target_quant,
                                    "draft_quant": args.draft_quant, "max_k": args.max_k, "tokens": args.tokens,
                                    "prompts": args.prompts, "rows": rows, "escalation": escalation}, indent=2))


if __name__ == "__main__":
    main()
