"""Streams longer than the KV cache: StreamingLLM's table on our models. Over one long text
(SQuAD paragraphs joined, >= 8,000 tokens) with a cache of --cache tokens:

- perplexity with the full context, with attention sinks plus a recent window, and with the
  window alone (no sinks), each token scored once with the window its 16-token chunk sees
  (the window's size is --cache less the chunk, so no token attends to more than --cache);
- KV blocks the sequence holds, sampled every 500 tokens as the text streams in, windowed
  and full;
- decode speed (tokens/s of 32 greedy tokens) after 1,000 and after 8,000 tokens, windowed
  and full.

Prints tables (ratios against the full context) and writes benchmarks/results/long_context.json.
The data is read from $SLUICE_DATA or ../shared/data (never copied into the repository).
Run it under `flock /tmp/sluice-heavy.lock` on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from common import RESULTS, ROOT, machine, write_results
from rich.console import Console
from rich.table import Table

from engine import KVWindow
from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

console = Console()
PARTS = ["perplexity", "blocks_held", "decode_tok_s"]


def squad_text(data_dir: Path) -> str:
    articles = json.loads((data_dir / "squad-v1.1-dev-part-a.json").read_text())["data"]
    return "\n\n".join(p["context"] for a in articles for p in a["paragraphs"])


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def blocks_held(engine: LLMEngine, ids: list[int], window: KVWindow | None, every: int,
                salt: bytes) -> list[tuple[int, int]]:
    """(tokens in, KV blocks the sequence holds) as the text streams in as a prompt, in chunks
    of `every` tokens (the engine's step budget). Salted, one salt per run, so the prefix cache
    (which scoring and the other run filled with this text) does not hand the prompt over."""
    rid = engine.add_request(ids, SamplingParams(max_tokens=1), window=window, salt=salt)
    seq, out = engine.requests[rid][1], []
    while rid in engine.requests:
        engine.step()
        if rid in engine.requests:
            out.append((seq.num_computed_tokens, len(seq.block_table) + len(seq.sink_source)))
    return out


def decode_speed(engine: LLMEngine, ids: list[int], window: KVWindow | None, n: int) -> float:
    """Tokens/s of n greedy tokens after the prompt `ids`, prefill excluded."""
    rid = engine.add_request(ids, SamplingParams(max_tokens=n + 1, ignore_eos=True), window=window)
    first = None
    while True:
        outs = engine.step()
        if first is None and any(o.request_id == rid and o.new_token_ids for o in outs):
            first = time.perf_counter()
        if any(o.request_id == rid and o.completion for o in outs):
            return n / (time.perf_counter() - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8192, help="length of the stream")
    ap.add_argument("--cache", type=int, default=1024, help="the most tokens a query attends to")
    ap.add_argument("--sinks", type=int, default=4, help="sink tokens (kept as whole 16-token blocks)")
    ap.add_argument("--chunk", type=int, default=16, help="tokens scored per pass with a window")
    ap.add_argument("--decode-at", type=int, nargs="+", default=[1000, 8000])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("SLUICE_DATA", ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS,
                    help="what to measure; the others' rows are kept from --out's JSON")
    args = ap.parse_args()
    out = args.out or RESULTS / f"long_context_{args.model}.json"
    bs, chunk = 16, args.chunk
    engine = LLMEngine(EngineConfig(models={"m": ModelEntry(args.model)}, block_size=bs, max_num_batched_tokens=500,
                                    max_kv_blocks=2 * (args.tokens // bs) + 64), progress=True)
    ids = engine.worker("m").tokenizer.encode(squad_text(args.data))[:args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    size = args.cache - chunk + 1
    windows = {"full context": None, f"sinks ({args.sinks}) + window": KVWindow(args.sinks, size),
               "window, no sinks": KVWindow(0, size)}
    results = {"model": args.model, "tokens": len(ids), "cache": args.cache, "window_size": size, "chunk": chunk,
               "block_size": bs, "sink_tokens_kept": KVWindow(args.sinks, size).sink_tokens(bs),
               "machine": machine(), "perplexity": {}, "blocks_held": {}, "decode_tok_s": {}}
    if set(args.parts) != set(PARTS) and out.exists():
        kept = json.loads(out.read_text())
        results.update({k: kept[k] for k in PARTS if k not in args.parts and k in kept})
    for name, window in windows.items() if "perplexity" in args.parts else ():
        start = time.perf_counter()
        lp = engine.score(ids, window=window, chunk=chunk if window else 512)
        results["perplexity"][name] = {"all": perplexity(lp), "past_the_cache": perplexity(lp[args.cache:]),
                                       "seconds": time.perf_counter() - start}
        console.print(name, results["perplexity"][name])
        write_results(out, results)
    for name in ("full context", f"sinks ({args.sinks}) + window"):
        if "blocks_held" in args.parts:
            results["blocks_held"][name] = blocks_held(engine, ids, windows[name], 500, name.encode())
            console.print(name, "blocks held", results["blocks_held"][name])
        for at in args.decode_at if "decode_tok_s" in args.parts else ():
            results["decode_tok_s"].setdefault(name, {})[at] = decode_speed(engine, ids[:at], windows[name],
                                                                           args.decode_tokens)
            console.print(name, "decode at", at, results["decode_tok_s"][name][at])
        write_results(out, results)
    report(results)


def report(r: dict) -> None:
    ppl, full = r["perplexity"], r["perplexity"]["full context"]
    table = Table(title=f"{r['model']}: perplexity over {r['tokens']} SQuAD tokens, cache {r['cache']} tokens")
    for col in ("attention", "perplexity", "x full", f"past token {r['cache']}", "x full", "seconds"):
        table.add_column(col)
    for name, p in ppl.items():
        table.add_row(name, f"{p['all']:.3f}", f"{p['all'] / full['all']:.3f}", f"{p['past_the_cache']:.3f}",
                      f"{p['past_the_cache'] / full['past_the_cache']:.3f}", f"{p['seconds']:.0f}")
    console.print(table)
    held = Table(title="KV blocks held (16 tokens each) as the stream comes in")
    held.add_column("tokens in")
    for name in r["blocks_held"]:
        held.add_column(name)
    rows = list(zip(*r["blocks_held"].values()))
    for row in rows:
        held.add_row(str(row[0][0]), *(str(b) for _, b in row))
    console.print(held)
    speed = Table(title=f"decode tokens/s after n tokens ({r['machine']['threads']} threads)")
    speed.add_column("attention")
    ats = list(next(iter(r["decode_tok_s"].values())))
    for at in ats:
        speed.add_column(f"at {at}")
    speed.add_column(f"at {ats[-1]} / at {ats[0]}")
    for name, by_at in r["decode_tok_s"].items():
        speed.add_row(name, *(f"{by_at[a]:.2f}" for a in ats), f"{by_at[ats[-1]] / by_at[ats[0]]:.3f}")
    console.print(speed)


if __name__ == "__main__":
    main()
