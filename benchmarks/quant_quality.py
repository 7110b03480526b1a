"""What weight quantization costs in quality: perplexity on a fixed SQuAD text and exact
match / F1 on the same SQuAD questions answered from their gold paragraph, for each model at
none (float32: the GGUF's blocks dequantized, the reference), gguf (the same blocks as stored, on
int8 activations), int8 and int4, and fp8 (those float32 weights rounded to e4m3 per output
channel, activations per token: on the CPU the float32 emulation of what FP8 tensor cores
compute) (and with --kv, each KV cache dtype). `int8` and `int4` decode on torch's
packed ops, `int8-dot` and `int4-dot` on integer dot products on int8 activations
(ModelEntry.dot_rows = 1); prompts run where the engine's default puts them (on the integer
kernels where the compiled AVX2 ones serve, else on dequantized float32 weights, but for packed
int4). `--cpu-kernels off on` answers each also with a layer's other kernels on their PyTorch
twins and compiled (EngineConfig.cpu_kernels), `--prompts default dequantized` with the prompts
on the default path and on dequantized weights (ModelEntry.dequant_rows), and each counts the
answers that differ from the first of its rows. `--gguf-steps 1 8` answers gguf with its K-quants'
activations on one int8 scale per 256 values (llama.cpp's q8_K) and on a step per 32 of them
(ModelEntry.gguf_steps), in the projections `--gguf-steps-on` names (ModelEntry.gguf_steps_on).
Prints a table and writes benchmarks/results/quant_quality.json.

The data is read from $SLUICE_DATA or ../shared/data (never copied into the repository).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
from pathlib import Path

from common import RESULTS, ROOT
from rich.console import Console
from rich.table import Table

from engine.config import GGUF_PROJECTIONS, GGUF_STEPS_ON, EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.quantize import DEQUANT_ROWS
from engine.sampling_params import SamplingParams
from evals.metrics import exact_match, f1
from retrieval import Chunk, build_prompt

console = Console()
QA_INSTRUCTIONS = ("Answer the question with the shortest exact phrase from the passage below. "
                   "Reply with the phrase only.")


def squad(data_dir: Path, n: int, seed: int) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    articles = json.loads((data_dir / "squad-v1.1-dev-part-a.json").read_text())["data"]
    paragraphs = [p for a in articles for p in a["paragraphs"]]
    qas = [(p["context"], qa["question"], [a["text"] for a in qa["answers"]]) for p in paragraphs for qa in p["qas"]]
    return [p["context"] for p in paragraphs], random.Random(seed).sample(qas, n)


def steps_label(row: dict) -> str:
    """A row's gguf steps and the projections taking them, for the table."""
    if not row["gguf_steps"]:
        return "-"
    on = row.get("gguf_steps_on")
    if not on:
        return str(row["gguf_steps"])
    return f"{row['gguf_steps']} on {'all' if len(on) == len(GGUF_PROJECTIONS) else ', '.join(on)}"


def projections(names: str) -> tuple[str, ...]:
    """`--gguf-steps-on`'s value: comma-separated projection names, or all."""
    chosen = GGUF_PROJECTIONS if names == "all" else tuple(names.split(","))
    if unknown := set(chosen) - set(GGUF_PROJECTIONS):
        raise argparse.ArgumentTypeError(f"no projection {', '.join(sorted(unknown))}; "
                                         f"known: {', '.join(GGUF_PROJECTIONS)}, all")
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--quants", nargs="+", default=["none", "gguf", "int8-dot", "int4-dot"],
                    choices=["none", "gguf", "int8", "int8-dot", "int4", "int4-dot", "fp8"])
    ap.add_argument("--kv", nargs="+", default=["float32"], choices=["float32", "int8"], help="KV cache dtypes")
    ap.add_argument("--cpu-kernels", nargs="+", default=["on"], choices=["on", "off"])
    ap.add_argument("--prompts", nargs="+", default=["default"], choices=["default", "dequantized"])
    ap.add_argument("--gguf-steps", nargs="+", type=int, default=[1],
                    help="gguf: the K-quants' activation steps per block (ModelEntry.gguf_steps; 1: one scale per 256)")
    ap.add_argument("--gguf-steps-on", nargs="+", type=projections, default=[GGUF_STEPS_ON],
                    help="gguf: sets of projections that take those steps, each its own row: comma-separated "
                         f"names of {', '.join(GGUF_PROJECTIONS)}, or all (ModelEntry.gguf_steps_on)")
    ap.add_argument("--questions", type=int, default=100, help="0: perplexity only")
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("SLUICE_DATA", ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", type=Path, default=RESULTS / "quant_quality.json")
    args = ap.parse_args()
    contexts, questions = squad(args.data, args.questions, seed=0)
    rows, answered = [], {}
    for model in args.models:
        for quant, kv, compiled, path, steps, on in [
                (q, kv, c, p, st, on) for q in args.quants for kv in args.kv for c in args.cpu_kernels
                for p in args.prompts for st in (args.gguf_steps if q == "gguf" else [1])
                for on in (args.gguf_steps_on if q == "gguf" and st > 1 else [GGUF_STEPS_ON])]:
            entry = ModelEntry(model, quant=quant.removesuffix("-dot"), dot_rows=int(quant.endswith("-dot")),
                               dequant_rows=DEQUANT_ROWS["cpu"] if path == "dequantized" else None, gguf_steps=steps,
                               gguf_steps_on=on)
            engine = LLMEngine(EngineConfig(models={"m": entry}, max_kv_blocks=2048, kv_cache_dtype=kv,
                                            cpu_kernels=compiled == "on"), progress=False)
            tok = engine.worker("m").tokenizer
            text_ids = tok.encode("\n\n".join(contexts[:40]))[:args.ppl_tokens]
            ppl = math.exp(-sum(lp := engine.score(text_ids)) / len(lp))
            em = f = differ = None
            if questions:
                prompts = [tok.apply_chat_template(build_prompt(q, [Chunk("gold", 0, ctx)], QA_INSTRUCTIONS).messages)
                           for ctx, q, _ in questions]
                outs = engine.generate(prompts, SamplingParams(max_tokens=32, stop=["\n"]), progress=True)
                answers = [c.text.strip() for c in outs]
                em = 100 * sum(exact_match(a, g) for a, (_, _, g) in zip(answers, questions)) / len(questions)
                f = 100 * sum(f1(a, g) for a, (_, _, g) in zip(answers, questions)) / len(questions)
                other = answered.setdefault((model, quant, kv), answers)
                differ = sum(a != b for a, b in zip(answers, other))
            rows.append({"model": model, "quant": quant, "kv": kv, "cpu_kernels": compiled, "prompts": path,
                         "gguf_steps": steps if quant == "gguf" else None,
                         "gguf_steps_on": list(on) if quant == "gguf" and steps > 1 else None,
                         "dequant_rows": engine.worker("m").dequant_rows, "perplexity": ppl,
                         "exact_match": em, "f1": f, "answers_differing_from_the_first_row": differ})
            console.print(rows[-1])
            write(args, rows)                 # after each row: a run cut short keeps what it measured
            del engine
    table = Table(title=f"Quantization quality: perplexity on {args.ppl_tokens} SQuAD tokens; "
                        f"EM/F1 on {args.questions} SQuAD questions with their gold paragraph")
    for col in ("model", "quant", "kv", "layer kernels", "prompts", "gguf steps", "perplexity", "EM", "F1",
                "EM vs the model's first row", "answers differing"):
        table.add_column(col)
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"])
        scores = [f"{r['exact_match']:.1f}", f"{r['f1']:.1f}", f"{r['exact_match'] - base['exact_match']:+.1f}",
                  str(r["answers_differing_from_the_first_row"])] if questions else ["-"] * 4
        table.add_row(r["model"], r["quant"], r["kv"], r["cpu_kernels"], r["prompts"], steps_label(r),
                      f"{r['perplexity']:.4f} ({r['perplexity'] / base['perplexity'] - 1:+.2%})",
                      *scores)
    console.print(table)
    console.print(f"wrote {args.out}")


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"questions": args.questions, "ppl_tokens": args.ppl_tokens, "rows": rows},
                                   indent=2))


if __name__ == "__main__":
    main()
