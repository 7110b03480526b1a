"""Sluice's engine against transformers, same models, same machine, same run.

    (a) one request: decode tokens/s, and the fraction of the measured memory bandwidth
    (b) 16 concurrent requests, prompts of 50-1,500 tokens and outputs of 16-256:
        total tokens/s and p50/p95 latency (transformers one by one and batched with padding;
        the faster is the baseline)
    (c) time to first token with a 1,500-token prefix already cached, against cold

Prints a table of ratios and writes benchmarks/results/engine_bench.json.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
import transformers
from common import RESULTS, machine, memory_bandwidth_gbs, percentile, timed, write_results
from rich.console import Console
from rich.table import Table

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker import weight_bytes
from models.store import resolve

console = Console()


def workload(seed: int, n: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Ordinary token ids; content does not change the cost of a forward pass.
    return [([rng.randrange(1000, min(vocab, 30000)) for _ in range(rng.randint(50, 1500))], rng.randint(16, 256))
            for _ in range(n)]


def sluice_engine(name: str, prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(models={"m": ModelEntry(name)}, max_kv_blocks=2048,
                                  prefix_caching=prefix_caching), progress=False)


# ---- (a) single-request decode -------------------------------------------------------
def decode_speed(engine: LLMEngine, hf, prompt: list[int], n: int) -> dict:
    p = SamplingParams(max_tokens=n, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))     # warm up
    c = engine.generate([prompt], p)[0]
    sluice = (n - 1) / (c.latency - c.ttft)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        first = timed(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False))
        total = timed(lambda: hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False))
    return {"sluice_tok_s": sluice, "hf_tok_s": (n - 1) / (total - first)}


# ---- (b) 16 concurrent requests ------------------------------------------------------
def concurrent(engine: LLMEngine, hf, reqs: list[tuple[list[int], int]], hf_modes: list[str]) -> dict:
    out_tokens = sum(n for _, n in reqs)
    start = time.perf_counter()
    done = engine.generate([p for p, _ in reqs], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs])
    wall = time.perf_counter() - start
    result = {"output_tokens": out_tokens,
              "sluice": {"wall_s": wall, "tok_s": out_tokens / wall,
                         "p50_s": percentile([c.latency for c in done], 0.5),
                         "p95_s": percentile([c.latency for c in done], 0.95)}}
    with torch.no_grad():
        if "sequential" in hf_modes:
            finish, t0 = [], time.perf_counter()
            for p, n in reqs:
                hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
                finish.append(time.perf_counter() - t0)      # all arrived at t0
            result["hf_sequential"] = {"wall_s": finish[-1], "tok_s": out_tokens / finish[-1],
                                       "p50_s": percentile(finish, 0.5), "p95_s": percentile(finish, 0.95)}
        if "batched" in hf_modes:
            width = max(len(p) for p, _ in reqs)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in reqs])        # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in reqs])
            wall = timed(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in reqs),
                                              min_new_tokens=max(n for _, n in reqs), do_sample=False,
                                              pad_token_id=0))
            # Every request of a padded batch finishes when the longest does.
            result["hf_batched"] = {"wall_s": wall, "tok_s": out_tokens / wall, "p50_s": wall, "p95_s": wall}
    return result


# ---- (c) TTFT with a cached 1,500-token prefix ---------------------------------------
def cached_ttft(name: str, vocab: int) -> dict:
    rng = random.Random(7)
    prefix = [rng.randrange(1000, min(vocab, 30000)) for _ in range(1500)]
    questions = [[rng.randrange(1000, 30000) for _ in range(24)] for _ in range(4)]
    p = SamplingParams(max_tokens=1)
    warm_engine = sluice_engine(name)
    warm_engine.generate([prefix + questions[0]], p)                   # fills the prefix cache
    warm = [warm_engine.generate([prefix + q], p)[0] for q in questions[1:]]
    assert all(c.num_cached_tokens >= 1488 for c in warm), "prefix cache missed"
    del warm_engine
    cold_engine = sluice_engine(name, prefix_caching=False)
    cold = [cold_engine.generate([prefix + q], p)[0] for q in questions[1:3]]
    return {"cold_ttft_s": statistics.median(c.ttft for c in cold),
            "cached_ttft_s": statistics.median(c.ttft for c in warm),
            "cached_tokens": warm[0].num_cached_tokens}


def run(name: str, hf_modes: list[str], decode_tokens: int) -> dict:
    folder = resolve(name)
    engine = sluice_engine(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = engine.worker("m").cfg
    read_per_token = weight_bytes(engine.worker("m").model, per_token=True)
    prompt = engine.worker("m").tokenizer.encode("Tell me a long story about a dragon who learns to fly.")
    console.print(f"[bold]{name}[/]: (a) decode")
    a = decode_speed(engine, hf, prompt, decode_tokens)
    a["read_gb_per_token"] = read_per_token / 1e9
    console.print(f"[bold]{name}[/]: (b) 16 concurrent requests")
    b = concurrent(engine, hf, workload(0, 16, cfg.vocab_size), hf_modes)
    del engine
    console.print(f"[bold]{name}[/]: (c) cached vs cold TTFT")
    c = cached_ttft(name, cfg.vocab_size)
    return {"a_decode": a, "b_concurrent": b, "c_ttft": c}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--hf-modes", nargs="+", default=["sequential", "batched"], choices=["sequential", "batched"])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_bench.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = memory_bandwidth_gbs()
    results = {"machine": machine() | {"read_bandwidth_gbs": bw}, "models": {}}
    for name in args.models:
        results["models"][name] = run(name, args.hf_modes, args.decode_tokens)
    table = Table(title=f"Sluice vs transformers (float32, {torch.get_num_threads()} threads, "
                        f"read bandwidth {bw:.1f} GB/s)")
    for col in ("model", "metric", "sluice", "transformers", "ratio", "target"):
        table.add_column(col)
    for name, r in results["models"].items():
        a, b, c = r["a_decode"], r["b_concurrent"], r["c_ttft"]
        frac = a["sluice_tok_s"] * a["read_gb_per_token"] / bw
        a["sluice_bandwidth_fraction"] = frac
        a["hf_bandwidth_fraction"] = a["hf_tok_s"] * a["read_gb_per_token"] / bw
        table.add_row(name, "(a) decode tok/s", f"{a['sluice_tok_s']:.2f} ({frac:.0%} of bw)",
                      f"{a['hf_tok_s']:.2f} ({a['hf_bandwidth_fraction']:.0%} of bw)",
                      f"{a['sluice_tok_s'] / a['hf_tok_s']:.2f}x", ">= 1.3x")
        base_key = max((k for k in b if k.startswith("hf_")), key=lambda k: b[k]["tok_s"])
        base = b[base_key]
        b["baseline"] = base_key
        table.add_row(name, "(b) 16 req tok/s", f"{b['sluice']['tok_s']:.2f}",
                      f"{base['tok_s']:.2f} ({base_key[3:]})", f"{b['sluice']['tok_s'] / base['tok_s']:.2f}x", ">= 5x")
        table.add_row(name, "(b) p50 / p95 latency s", f"{b['sluice']['p50_s']:.1f} / {b['sluice']['p95_s']:.1f}",
                      f"{base['p50_s']:.1f} / {base['p95_s']:.1f}", "", "")
        table.add_row(name, "(c) TTFT cached / cold s", f"{c['cached_ttft_s']:.3f} / {c['cold_ttft_s']:.2f}", "",
                      f"1/{c['cold_ttft_s'] / c['cached_ttft_s']:.0f}", "<= 1/20")
    console.print(table)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
