"""Sluice's engine on a CUDA GPU, against transformers on the same GPU and weights.

    decode     tokens/s at batch 1, 16 and 64 for each model in bf16, int8, int4 and fp8 (FP8
               tensor cores from compute capability 8.9; the batch buckets each precision
               runs dense, and the bf16 layers' buckets on the Triton GEMV, from
               engine/precision_buckets.json, are recorded), and the
               fraction of the weight-read roofline (weights read once per step, at the
               device-to-device copy bandwidth measured in the same run)
    overhead   the engine's decode step (scheduling, index tensors, replay, sampling, output)
               against the CUDA-graph replay of the same model step alone (target <= 1.15x)
    ttft       a 1,500-token prompt whose prefix is cached against the same prompt cold
    label      one proxy label (evals/lab/proxy.py): an 8-token reference scored after a cold
               512-token prompt, as `evals proxy` labels a SQuAD question per model
    baseline   transformers' generate with a static KV cache (its best recipe), bf16

Real weights when the model store has them cached, else random weights with the real shapes
(said in the output; speed does not depend on the values). Prints a table and writes
benchmarks/results/gpu_bench-<device>.json, merging models measured in earlier runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import re
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, machine
from rich.console import Console
from rich.table import Table

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker import weight_bytes
from models.store import DEFAULT_MODELS, cache_dir, resolve

console = Console()
# The shapes of the served models (their config.json as the store converts them), for random weights.
SHAPES = {
    "qwen2.5-coder-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-coder-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2),
}
VOCAB = 151936


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB, bytes read plus written, best of ten."""
    x = torch.empty(2**29, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * x.element_size() / best / 1e9


def model_folder(name: str, scratch: Path) -> tuple[Path, str]:
    """The store's folder when its weights are cached here, else random bf16 weights with the
    real shapes and a word-level tokenizer over the same vocabulary size."""
    if (cache_dir() / "models" / name / ".sluice-complete").is_file():
        return resolve(name, progress=False), "real"
    folder = scratch / name
    if not (folder / "model.safetensors").is_file():
        import transformers
        from tokenizers import Tokenizer, models, pre_tokenizers
        cfg = transformers.Qwen2Config(vocab_size=VOCAB, max_position_embeddings=32768, rope_theta=1e6,
                                       tie_word_embeddings=False, eos_token_id=VOCAB - 1, **SHAPES[name])
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB - 1)} | {"<eos>": VOCAB - 1}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder, "random"


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


def engine_decode(engine: LLMEngine, batch: int, tokens: int) -> dict:
    """Steady-state decode of `batch` requests (all prefilled first), then the replay alone of
    the captured graphs the steps used (the layers' and the head's)."""
    rng = random.Random(batch)
    for _ in range(batch):
        engine.add_request(ids(rng, 32), SamplingParams(max_tokens=tokens, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    n, steps, start = 0, 0, time.perf_counter()
    while engine.has_work():
        n += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    out = {"tok_s": n / elapsed, "step_ms": 1e3 * elapsed / steps}
    graphs = engine.worker("m").runner.graphs
    if graphs is not None:
        bucket = next(b for b in graphs.buckets if b >= batch)
        graphs.replay(bucket)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            graphs.replay(bucket)
        torch.cuda.synchronize()
        out["replay_ms"] = 1e3 * (time.perf_counter() - start) / 50
        out["engine_over_replay"] = out["step_ms"] / out["replay_ms"]
    return out


# Kernel names (cuBLAS's, torch's, ours) by the part of the step they belong to, first match wins.
PARTS = [("bf16 gemv (triton)", r"^_gemv_(reduce_)?kernel"),
         ("quantized matmul", r"_int8_kernel|_int4_kernel|int4pack|tinygemm"),
         ("attention", r"_decode_kernel|_prefill_kernel|_reduce|flash|attention"),
         ("rotary + KV store", r"rotary|store_kv"),
         ("norms", r"rms_norm"),
         ("activation", r"silu"),
         ("dense matmul", r"gemm|gemv|cutlass|nvjet|sm90_|xmma|splitK|Kernel2"),
         ("sampling + logits", r"argmax|max|softmax|isfinite|logsumexp|index|gather|reduce"),
         ("other", r".")]


def profile_step(engine: LLMEngine, batch: int, graphs: bool, steps: int = 3) -> dict:
    """The kernels of a steady decode step at `batch` (torch profiler over `steps` steps, eager
    or replayed from the captured graphs): device time per kernel and per part of the step,
    against the step's wall time; what is left of the wall time is host work and launch gaps."""
    from torch.profiler import ProfilerActivity, profile
    runner = engine.worker("m").runner
    saved, runner.graphs = runner.graphs, runner.graphs if graphs else None
    rng = random.Random(batch)
    for _ in range(batch):
        engine.add_request(ids(rng, 32), SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    while engine.has_work():
        engine.step()
    runner.graphs = saved
    kernels: dict[str, float] = {}
    launches = 0
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
            launches += 1
    parts: dict[str, float] = {}
    for name, us in kernels.items():
        part = next(p for p, pattern in PARTS if re.search(pattern, name))
        parts[part] = parts.get(part, 0.0) + us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_us": wall * 1e6, "kernel_us": sum(kernels.values()), "kernels_per_step": launches / steps,
            "parts_us": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
            "top_kernels_us": {name[:90]: us for name, us in top}}


def ttft(engine: LLMEngine) -> dict:
    """A 1,500-token shared prefix: cached (same salt as the request that filled it) against
    cold (a new salt each time, so nothing is shared)."""
    rng = random.Random(7)
    prefix, p = ids(rng, 1500), SamplingParams(max_tokens=1)
    engine.generate([prefix + ids(rng, 24)], p, salt=b"warm")
    warm = [engine.generate([prefix + ids(rng, 24)], p, salt=b"warm")[0] for _ in range(3)]
    cold = [engine.generate([prefix + ids(rng, 24)], p, salt=f"cold{i}".encode())[0] for i in range(3)]
    assert all(c.num_cached_tokens >= 1488 for c in warm), "prefix cache missed"
    return {"cached_s": sorted(c.ttft for c in warm)[1], "cold_s": sorted(c.ttft for c in cold)[1]}


def label_cost(engine: LLMEngine, n: int = 32) -> dict:
    """Seconds per proxy label: `score` of an 8-token reference after a 512-token prompt nothing
    has cached (a new prompt each time), the median of `n`."""
    rng = random.Random(5)
    engine.score(ids(rng, 520), "m", first=512)                     # warm-up
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.score(ids(rng, 520), "m", first=512)
        times.append(time.perf_counter() - start)
    return {"score_s": sorted(times)[n // 2]}


def hf_decode(folder: Path, batches: list[int], tokens: int) -> dict:
    """transformers' generate with a static KV cache (which compiles its decoding step), bf16."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    out = {}
    for batch in batches:
        prompt = torch.tensor([ids(random.Random(batch), 32) for _ in range(batch)], device="cuda")

        def gen(n: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,  # noqa: F821
                           do_sample=False, cache_implementation="static", pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start
        gen(tokens)                         # compiles
        first, total = gen(1), gen(tokens)
        out[batch] = {"tok_s": batch * (tokens - 1) / (total - first)}
        console.print(f"  transformers static cache, batch {batch}: {out[batch]['tok_s']:.0f} tok/s")
    del model
    free_cuda()
    return out


def run_model(name: str, args, bw: float, save) -> dict:
    """Every quantization of one model; `save(result)` after each, so a run cut short keeps them."""
    folder, weights = model_folder(name, args.scratch)
    console.print(f"[bold]{name}[/]: {weights} weights ({folder})")
    result = {"weights": weights, "quants": {}}
    for quant in args.quants:
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(models={"m": ModelEntry(str(folder), quant=quant)}, device="cuda",
                                        max_num_seqs=max(args.batches), max_num_batched_tokens=2048,
                                        gpu_memory_utilization=args.gpu_memory_utilization,
                                        cuda_graphs=not args.eager), progress=False)
        read = weight_bytes(engine.worker("m").model, per_token=True)
        r = {"load_s": time.perf_counter() - t0, "read_gb_per_step": read / 1e9, "decode": {},
             "dense_buckets": engine.stats()["m"]["dense_buckets"], "gemv_buckets": engine.stats()["m"]["gemv_buckets"]}
        if r["gemv_buckets"]:
            console.print(f"  {quant}: the Triton GEMV at batch sizes {r['gemv_buckets']} (by layer kind)")
        for batch in args.batches:
            d = engine_decode(engine, batch, args.decode_tokens)
            # Decode reads the weights once per step, whatever the batch.
            d["roofline_fraction"] = (read / (bw * 1e9)) / (d["step_ms"] / 1e3)
            r["decode"][batch] = d
            console.print(f"  {quant} batch {batch}: {d['tok_s']:.0f} tok/s, step {d['step_ms']:.2f} ms"
                          + (f" (replay {d['replay_ms']:.2f} ms)" if "replay_ms" in d else "")
                          + f", {d['roofline_fraction']:.0%} of the weight-read roofline")
        r["profile"] = {f"{batch}{'' if graphs else ' eager'}": profile_step(engine, batch, graphs)
                        for batch in args.profile_batches for graphs in (True, False)}
        for key, p in r["profile"].items():
            console.print(f"  {quant} profile batch {key}: step {p['wall_us']:.0f} µs, "
                          f"kernels {p['kernel_us']:.0f} µs: "
                          + ", ".join(f"{part} {us:.0f}" for part, us in p["parts_us"].items()))
        r["ttft"] = ttft(engine)
        console.print(f"  {quant} TTFT cached {r['ttft']['cached_s'] * 1e3:.1f} ms / "
                      f"cold {r['ttft']['cold_s'] * 1e3:.1f} ms")
        r["label"] = label_cost(engine)
        console.print(f"  {quant} proxy label {r['label']['score_s'] * 1e3:.1f} ms")
        result["quants"][quant] = r
        save(result)
        del engine
        free_cuda()
    if args.hf_batches:
        result["transformers_static"] = hf_decode(folder, args.hf_batches, args.decode_tokens)
    return result


def targets(r: dict) -> list[dict]:
    """Issue 53's targets for one model, from the quantizations and batches this run measured."""
    q = r["quants"]
    decode = {name: {int(b): d for b, d in x["decode"].items()} for name, x in q.items()}
    rows = []

    def add(target: str, measured: float, op: str, goal: float) -> None:
        rows.append({"target": target, "measured": measured, "op": op, "goal": goal,
                     "met": measured >= goal if op == ">=" else measured <= goal})
    bf16 = decode.get("none", {})
    if 1 in bf16:
        add("bf16 batch 1: share of the weight-read roofline", bf16[1]["roofline_fraction"], ">=", 0.6)
    if 64 in bf16:
        add("bf16 batch 64: tok/s", bf16[64]["tok_s"], ">=", 20000)
    for batch in (1, 64):
        if "engine_over_replay" in bf16.get(batch, {}):
            add(f"bf16 batch {batch}: engine step / graph replay", bf16[batch]["engine_over_replay"], "<=", 1.10)
    for quant, batch, goal in (("int8", 1, 1.5), ("int4", 1, 2.0), ("fp8", 1, 1.6), ("fp8", 64, 1.3)):
        if batch in bf16 and batch in decode.get(quant, {}):
            add(f"{quant} batch {batch} / bf16 (tok/s)", decode[quant][batch]["tok_s"] / bf16[batch]["tok_s"],
                ">=", goal)
    for quant in (q for q in decode if q != "none"):        # no precision slower than bf16 at any batch
        for batch in sorted(set(decode[quant]) & set(bf16)):
            add(f"{quant} batch {batch} / bf16, never below", decode[quant][batch]["tok_s"] / bf16[batch]["tok_s"],
                ">=", 1.0)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=[m for m in DEFAULT_MODELS if m in SHAPES])
    ap.add_argument("--quants", nargs="+", default=["none", "int8", "int4", "fp8"],
                    choices=["none", "int8", "int4", "fp8"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--hf-batches", nargs="*", type=int, default=[1, 16], help="none: skip transformers")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--profile-batches", nargs="*", type=int, default=[1, 64], help="none: no kernel profile")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="leaves room for transformers")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/sluice-gpu-bench"), help="random-weight folders")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"gpu_bench needs a CUDA GPU, and torch {torch.__version__} sees none here; "
                 "the CPU figures come from engine_bench.py and quant_bench.py")
    device = torch.cuda.get_device_name()
    out = RESULTS / f"gpu_bench-{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}.json"
    bw = copy_bandwidth_gbs()
    console.print(f"{device}: device-to-device copy {bw:.0f} GB/s (read + written)")
    results = json.loads(out.read_text()) if out.exists() else {"models": {}}
    results |= {"machine": machine() | {"device": device, "torch": torch.__version__, "copy_bandwidth_gbs": bw},
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}

    def save(name: str, result: dict) -> None:
        results["models"][name] = result
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
    for name in args.models:
        run_model(name, args, bw, lambda result, name=name: save(name, result))
    table = Table(title=f"Sluice on {device} (copy bandwidth {bw:.0f} GB/s)")
    for col in ("model", "weights", "batch", "tok/s", "roofline", "step / replay", "transformers static",
                "TTFT cached / cold", "proxy label"):
        table.add_column(col)
    for name, r in results["models"].items():
        hf = r.get("transformers_static", {})
        for quant, q in r["quants"].items():
            for batch, d in q["decode"].items():
                base = hf.get(batch) or hf.get(str(batch))
                table.add_row(name, f"{quant} ({r['weights']})", str(batch), f"{d['tok_s']:.0f}",
                              f"{d['roofline_fraction']:.0%}",
                              f"{d['engine_over_replay']:.2f}x" if "engine_over_replay" in d else "eager",
                              f"{base['tok_s']:.0f} ({d['tok_s'] / base['tok_s']:.1f}x)" if base and quant == "none"
                              else "",
                              f"{q['ttft']['cached_s'] * 1e3:.0f} / {q['ttft']['cold_s'] * 1e3:.0f} ms",
                              f"{q['label']['score_s'] * 1e3:.1f} ms" if "label" in q else "")
    console.print(table)
    results["targets"] = {name: targets(r) for name, r in results["models"].items()}
    goals = Table(title="Issue 53's targets")
    for col in ("model", "target", "measured", "goal", "met"):
        goals.add_column(col)
    for name, rows in results["targets"].items():
        for row in rows:
            goals.add_row(name, row["target"], f"{row['measured']:.2f}", f"{row['op']} {row['goal']}",
                          "met" if row["met"] else "[red]missed[/]")
    console.print(goals)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
