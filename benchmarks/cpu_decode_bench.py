"""Sluice against llama.cpp on the CPU, on the same GGUF files, in the same run.

llama.cpp is built once from the sources vendored in the pinned llama-cpp-python sdist
(downloaded with pip, `-DGGML_NATIVE=ON`, cached under $SLUICE_CACHE/llama.cpp/<version>/ and
built again on a host whose CPU flags differ):
`llama-bench` for one sequence (decode of 64 tokens, prefill of a 512-token prompt) and
`llama-batched-bench` for 8 sequences decoding together. Sluice runs the same models from the
model store on the GGUF's own blocks (`gguf`: the same bytes llama.cpp reads), and at int8 and int4
quantized from their float32 dequantization, each on torch's packed op on bf16 activations (`int8`,
`int4`) and on integer dot products on int8 activations (`int8-dot`, `int4-dot`: ModelEntry.dot_rows = 1);
prompts run on dequantized float32 weights wherever the stored format is kept (all but packed
int4). `--cpu-kernels` picks how a layer's other kernels run, each setting its own engine: `off`
their PyTorch twins (EngineConfig.cpu_kernels off), `on` the compiled ones of kernels/layer_cpu.py
called from Python (cpu_step off), `step` a decode step's layers in one compiled call
(engine/cpu_step.py, the default). `--gguf-steps 1 8` runs gguf with its K-quants' activations
on one scale per 256 and on a step per 32 in ModelEntry.gguf_steps_on's projections. The two
engines take turns, median of 3, all on the same threads.

`--isa avx2` measures an AVX2-only host's code on any x86 host that has AVX2: llama.cpp built
with `-DGGML_NATIVE=OFF` (ggml's portable set: AVX, AVX2, FMA, F16C, BMI2, no AVX-512), Sluice's
kernels without VNNI (SLUICE_CPU_VNNI=0) and torch's own kernels held to AVX2
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS). The instructions are an AVX2
host's; the cores, caches and memory are this one's, so it tells the code paths apart, not the
hosts.

For each it prints tokens/s, the GB/s that reading the weights once per step implies, that as a
share of the read bandwidth, and Sluice's ratio to llama.cpp. The bandwidth is sampled in every
turn of a decode row, after the two engines, and the share taken of that row's median: on a
shared host it moves (31 to 64 GB/s within one run on a 2-core EPYC), so one figure from the
run's start would misstate the rows after it; it writes
benchmarks/results/cpu_decode_bench.json with the host's ISA, and with each row the weights'
bytes as loaded (what the start-up log states) and the GGUF file's size. Where llama.cpp cannot be built it
says why and exits 2: it never quotes figures from another run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
from common import RESULTS, machine, memory_bandwidth_gbs, write_results
from rich.console import Console
from rich.table import Table

from engine.config import GGUF_STEPS, EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker import weight_bytes
from kernels.cpu_build import vnni
from models.store import cache_dir, resolve

LLAMA_CPP_PYTHON = "0.3.36"      # the pinned sdist whose vendor/llama.cpp is built
TOOLS = ("llama-bench", "llama-batched-bench")
console = Console(width=150)


# An AVX2-only host's instruction sets, for Sluice's kernels and torch's (read when torch loads).
AVX2_ENV = {"SLUICE_CPU_VNNI": "0", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def llama_cpp(isa: str = "native") -> Path:
    """The folder holding the tools built for `isa` ("native" or "avx2"), building them the first
    time (about 15 minutes on 2 cores). Exits 2, saying why, where that cannot be done."""
    root = cache_dir() / "llama.cpp" / LLAMA_CPP_PYTHON
    build = root / ("build" if isa == "native" else f"build-{isa}")
    bin_dir = build / "bin"
    # A native build is for the CPU it was built on: a cache carried to another host would run
    # it with instructions that host lacks (a crash) or without those it has (a slow baseline).
    flags = sorted(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")), []))
    host = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16] if isa == "native" else isa
    stamp = build / "host-cpu-flags.sha256"
    if all((bin_dir / t).is_file() for t in TOOLS) and stamp.is_file() and stamp.read_text() == host:
        return bin_dir
    shutil.rmtree(build, ignore_errors=True)

    def run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
        console.print(f"[dim]{what}: {' '.join(cmd)}[/]")
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        if done.returncode:
            console.print(done.stdout[-2000:], done.stderr[-3000:])
            console.print(f"cpu_decode_bench: {what} failed (exit {done.returncode}); llama.cpp is the baseline, "
                          "so nothing was measured")
            sys.exit(2)
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not src.is_dir():        # sources already there (a machine without the package index) skip the sdist
        sdist = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not sdist.is_file():
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)], "downloading the llama-cpp-python sdist")
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    native = "ON" if isa == "native" else "OFF"     # OFF: ggml's portable x86 set, AVX2 its widest
    run(["cmake", "-S", str(src), "-B", str(build), f"-DGGML_NATIVE={native}", "-DLLAMA_CURL=OFF",
         "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_SERVER=OFF"], "configuring llama.cpp")
    run(["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(os.cpu_count() or 2)], "building llama.cpp")
    stamp.write_text(host)
    return bin_dir


def gguf_read_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors a decode step reads: all of them but the embedding table,
    which is read whole only where it doubles as the LM head (tied embeddings, no output.weight)."""
    from gguf import GGUFReader
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def llama_decode(bin_dir: Path, gguf: Path, threads: int, batch: int, tokens: int) -> float:
    """Decode tokens/s over `batch` sequences (after a 32-token prompt each)."""
    if batch == 1:
        out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0",
                              "-n", str(tokens), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)[0]["avg_ts"]
    out = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c", "4096",
                          "-npp", "32", "-ntg", str(tokens), "-npl", str(batch), "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True)
    row = next(json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith("{"))
    return row["speed_tg"]


def llama_prefill(bin_dir: Path, gguf: Path, threads: int, prompt: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
                          "-n", "0", "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["avg_ts"]


def sluice_decode(engine: LLMEngine, batch: int, tokens: int, rng: random.Random) -> float:
    """Steady-state decode tokens/s of `batch` requests, after each has its first token."""
    vocab = engine.worker(None).cfg.vocab_size
    for _ in range(batch):
        engine.add_request([rng.randrange(1000, min(vocab, 30000)) for _ in range(32)],
                           SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    n, start = 0, time.perf_counter()
    while engine.has_work():
        n += sum(len(o.new_token_ids) for o in engine.step())
    return n / (time.perf_counter() - start)


def sluice_prefill(engine: LLMEngine, prompt: int, rng: random.Random) -> float:
    """Prompt tokens/s of one cold prompt (a new salt: nothing cached), to its first token."""
    vocab = engine.worker(None).cfg.vocab_size
    ids = [rng.randrange(1000, min(vocab, 30000)) for _ in range(prompt)]
    start = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=1), salt=str(rng.random()).encode())
    return prompt / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"],
                    help="model store names, or .gguf files (benchmarks/random_gguf.py makes one of a model's shapes)")
    ap.add_argument("--quants", nargs="+", default=["gguf", "int8-dot", "int4-dot"],
                    choices=["gguf", "int8", "int8-dot", "int4", "int4-dot"])
    ap.add_argument("--cpu-kernels", nargs="+", default=["step"], choices=["off", "on", "step"])
    ap.add_argument("--gguf-steps", nargs="+", type=int, default=[GGUF_STEPS],
                    help="gguf: the K-quants' activation steps per block in ModelEntry.gguf_steps_on's projections")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64, help="decoded per sequence")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="avx2: both engines on an AVX2-only host's instructions (above)")
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu_decode_bench.json")
    args = ap.parse_args()
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        if not torch.cpu._is_avx2_supported():
            console.print("cpu_decode_bench: --isa avx2 needs a host with AVX2")
            sys.exit(2)
        # torch reads its ISA when it loads, and it is loaded by now: run again with it set.
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | AVX2_ENV)
    torch.set_num_threads(args.threads)
    bin_dir = llama_cpp(args.isa)
    bandwidth = memory_bandwidth_gbs()
    console.print(f"read bandwidth {bandwidth:.1f} GB/s, {args.threads} threads, ISA {machine()['isa']}, "
                  f"llama.cpp built {args.isa}")
    rows, rng = [], random.Random(0)
    for model in args.models:
        folder = resolve(model, progress=False)
        gguf = Path(model) if model.endswith(".gguf") else cache_dir() / "gguf" / f"{model}.gguf"
        name = gguf.stem
        llama_bytes = gguf_read_bytes(gguf)
        for quant, compiled, steps in [(q, c, st) for q in args.quants for c in args.cpu_kernels
                                       for st in (args.gguf_steps if q == "gguf" else [1])]:
            entry = ModelEntry(str(folder), quant=quant.removesuffix("-dot"), dot_rows=int(quant.endswith("-dot")),
                               gguf_steps=steps)
            label = f"gguf, steps {steps}" if quant == "gguf" and steps > 1 else quant
            engine = LLMEngine(EngineConfig(models={"m": entry}, device="cpu",
                                            max_num_seqs=max(args.batches), num_threads=args.threads,
                                            memory_budget_gb=3.0, cpu_kernels=compiled != "off",
                                            cpu_step=compiled == "step"), progress=False)
            sluice_bytes = weight_bytes(engine.worker("m").model, per_token=True)
            # What the start-up log states the weights hold, against the file they came from.
            loaded = {"weight_bytes": weight_bytes(engine.worker("m").model), "gguf_file_bytes": gguf.stat().st_size}
            sluice_decode(engine, 1, 4, rng)                        # warm-up
            for what, batch in [("decode", b) for b in args.batches] + [("prefill", 1)]:
                runs: dict[str, list[float]] = {"sluice": [], "llama.cpp": []}
                read_gbs: list[float] = []
                for _ in range(args.repeats):                       # turn about
                    if what == "decode":
                        runs["sluice"].append(sluice_decode(engine, batch, args.tokens, rng))
                        runs["llama.cpp"].append(llama_decode(bin_dir, gguf, args.threads, batch, args.tokens))
                        read_gbs.append(memory_bandwidth_gbs(repeats=3))
                    else:
                        runs["sluice"].append(sluice_prefill(engine, args.prompt, rng))
                        runs["llama.cpp"].append(llama_prefill(bin_dir, gguf, args.threads, args.prompt))
                tok_s = {k: statistics.median(v) for k, v in runs.items()}
                # Decode reads the weights once per step, whatever the batch.
                gb_s = {"sluice": sluice_bytes, "llama.cpp": llama_bytes}
                gb_s = {k: gb_s[k] * tok_s[k] / batch / 1e9 for k in tok_s} if what == "decode" else {}
                rows.append({"model": name, "sluice_weights": label, "cpu_kernels": compiled,
                             "llama_cpp_weights": "gguf as stored",
                             "what": what, "batch": batch, "tokens": args.tokens if what == "decode" else args.prompt,
                             "tok_s": tok_s, "runs": runs, "gb_s": gb_s, "read_bandwidth_gbs": read_gbs,
                             "bandwidth_share": {k: v / statistics.median(read_gbs) for k, v in gb_s.items()},
                             "ratio": tok_s["sluice"] / tok_s["llama.cpp"]} | loaded)
                console.print(f"{name} {label} (layer kernels {compiled}) {what} batch {batch}: "
                              f"Sluice {tok_s['sluice']:.1f} tok/s, "
                              f"llama.cpp {tok_s['llama.cpp']:.1f} ({rows[-1]['ratio']:.2f}x)")
            del engine
    table = Table(title=f"CPU decode and prefill, Sluice against llama.cpp (shares of each row's read bandwidth; "
                        f"{bandwidth:.1f} GB/s at the start, "
                        f"{args.threads} threads, {machine()['isa']}, llama.cpp {args.isa})")
    for col in ("model", "Sluice weights", "layer kernels", "what", "batch", "Sluice tok/s", "GB/s (share)",
                "llama.cpp tok/s", "GB/s (share)", "read GB/s", "ratio"):
        table.add_column(col)
    for r in rows:
        share = {k: f"{r['gb_s'][k]:.1f} ({r['bandwidth_share'][k]:.0%})" if r["gb_s"] else "" for k in r["tok_s"]}
        read = f"{statistics.median(r['read_bandwidth_gbs']):.1f}" if r["read_bandwidth_gbs"] else ""
        table.add_row(r["model"], r["sluice_weights"], r["cpu_kernels"], r["what"], str(r["batch"]),
                      f"{r['tok_s']['sluice']:.1f}", share["sluice"], f"{r['tok_s']['llama.cpp']:.1f}",
                      share["llama.cpp"], read, f"[bold]{r['ratio']:.2f}x[/]")
    console.print(table)
    write_results(args.out, {"machine": machine() | {"read_bandwidth_gbs": bandwidth,
                                                     "llama_cpp_python": LLAMA_CPP_PYTHON,
                                                     "llama_cpp_build": args.isa, "cpu_vnni": vnni()},
                             "settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    main()
