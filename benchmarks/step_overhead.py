"""Host work per engine step: `LLMEngine.step` in full with the model call replaced by a
stub, in decode steady state at batch 1, 16 and 64.

The stub's forward returns a preallocated hidden tensor and its LM head preallocated random
float32 logits (real values, so argmax and softmax cost what they cost), for a tiny
random-weight Qwen2 folder with a word-level tokenizer over the same vocabulary. Two forms:
a 1,024-token vocabulary (the bookkeeping alone: scheduling, block tables, index tensors,
sampling, stop checks, detokenizing, outputs) and Qwen2.5's 151,936 tokens (bookkeeping
plus the passes over the logits).

Each form and batch adds `batch` greedy requests (ignore_eos), steps until all of them
decode, then times --steps steps with perf_counter (median: ms per step, µs per sequence),
and as many again with the engine's calls wrapped, for a per-phase breakdown: schedule,
prepare, the forward stub, sampling (the rest of ModelRunner.run), postprocess and _output
(all its calls in the step). The wrappers cost a little, so the totals come from the plain
run. One pass over the logits is measured on its own as the reference: a log-softmax over
the step's rows, the least a step does (every token gets its log-probability). What the large
vocabulary adds to sampling, in those passes, is the step's count of passes (on CUDA both
are launch-bound, and the count says little).

Targets (issue 35): bookkeeping (the 1,024-token form's step) <= 1 ms at batch 64 and
<= 150 µs at batch 1; one pass over the logits per step (met when the count rounds to one).
On a shared host pass --threads 1 too: other tenants stall torch's OpenMP threads, which
small tensors pay for. Those rows run synchronously (EngineConfig.async_scheduling off), so
each phase is the host's.

Overlap (issue 53): the stub's forward also sleeps a graph replay's length (--stub-ms, 2 and
5 ms: the 1.5B's replays on the H100 and H200 run 1-2.5 ms), on the 1,024-token form at
batch 1 and 64, with async scheduling off (the host's work adds to the replay) and on (the
forward and sampling run on the runner's queue, a thread standing for the device, while the
host plans and prepares the next step). Target: the step's wall time <= 1.10x the stub's. With it
on, the main thread's work and the runner thread's beyond the forward, per step (one GIL runs
both).
Sampling (issue 53): at batch 1 and 64 on both forms, the same steps with every request
sampled (temperature 0.8, top_p 0.95, each seeded) instead of greedy, through the batched
sampler (`select` over all of a step's sampled rows, as the sampled head graphs hold it) and
through the per-row path it replaced (a copy of it below, installed on the runner: one
`torch.multinomial` per row after a sort of that row alone). Fewer steps (--sampled-steps):
at 151,936 tokens and batch 64 the top-p sort of every row dominates either path.
Prints tables and writes benchmarks/results/step_overhead.json.
"""
from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path

import torch
from common import RESULTS, machine, write_results
from rich.console import Console
from rich.table import Table

from engine.config import EngineConfig, ModelEntry
from engine.llm_engine import LLMEngine
from engine.sampler import verify
from engine.sampling_params import SamplingParams
from engine.sequence import failure

console = Console(width=140)
VOCABS = (1024, 151_936)            # bookkeeping alone; Qwen2.5's vocabulary
BATCHES = (1, 16, 64)
PROMPT_TOKENS = 128
PHASES = ("schedule", "prepare", "forward", "sampling", "postprocess", "output")
TARGET_MS = {64: 1.0, 1: 0.150}     # bookkeeping per step
STUB_MS = (2.0, 5.0)                # a replay's length, for the overlap rows
OVERLAP_BATCHES = (1, 64)
TARGET_RATIO = 1.10                 # step wall time over the stub's, async scheduling on
SAMPLED_BATCHES = (1, 64)
SAMPLED_STEPS = 10
PATHS = ("greedy", "batched", "per_row")     # the sampled rows' paths, against the same steps greedy


def model_folder(root: Path, vocab: int) -> Path:
    threads = torch.get_num_threads()
    from tests.conftest import make_tiny_model, write_word_tokenizer  # which sets the tests' 2 threads
    torch.set_num_threads(threads)
    folder = make_tiny_model(root / f"vocab{vocab}", "qwen2", tie=True, vocab_size=vocab, eos_token_id=vocab - 1,
                             max_position_embeddings=4096)
    write_word_tokenizer(folder, vocab)     # make_tiny_model's covers its own small vocabulary
    return folder


# ---- the per-row sampling path the batched sampler replaced (the baseline only) ----------
def legacy_sample(self, items, sampling, all_logits, logprobs, greedy, sampled, noise, selected, out,
                  return_probs) -> None:
    """ModelRunner._sample as it was: the head's greedy picks read back, then each sampled row
    alone (its distribution, one multinomial draw from its generator, its log-softmax). The
    distribution is tests/test_sampler.py's per-row reference, the batched sampler's specification."""
    from tests.test_sampler import reference_probs
    top, top_lp = greedy.T.tolist()
    top = [int(t) for t in top]
    at = 0
    for i in sampling:
        item = items[i]
        seq, first, at = item.seq, at, at + 1 + item.num_draft
        banned = self.bans is not None and seq.thinking is not None
        if seq.params.greedy and not item.num_draft and not banned and math.isfinite(top_lp[first]):
            out.token_ids[i], out.logprobs[i] = [top[first]], [top_lp[first]]
            continue
        try:
            if not all(map(math.isfinite, top_lp[first:at])):
                raise FloatingPointError("the model's logits for this request are not finite")
            logits = all_logits[first:at]
            end = item.start + item.num_tokens - item.num_draft
            for j in range(at - first if banned else 0):
                logits[j, self.bans(item, end + j)] = float("-inf")
            generator = self.device.generator(seq)
            if item.num_draft:
                tokens = verify(logits, item.draft, item.draft_probs, seq.params, generator)
            else:
                p = seq.params
                tokens = [int(logits[0].argmax()) if p.greedy else
                          int(torch.multinomial(reference_probs(logits[0], p), 1, generator=generator))]
            lp = torch.log_softmax(logits[:len(tokens)], -1).gather(
                1, torch.tensor(tokens, device=logits.device)[:, None])
            out.token_ids[i], out.logprobs[i] = tokens, lp.squeeze(1).tolist()
        except Exception as exc:
            out.errors[i] = failure(seq, exc)


class Stub:
    """The model's forward and LM head, preallocated: the step's host work is all that runs
    (and, with `sleep_s`, a forward of that length, which lets other threads run)."""

    def __init__(self, engine: LLMEngine, max_rows: int, sleep_s: float = 0.0):
        worker = engine.worker("m")
        model, device = worker.model, worker.runner.device
        g = torch.Generator().manual_seed(0)
        self.hidden = torch.zeros(engine.config.max_num_batched_tokens, model.cfg.hidden_size,
                                  dtype=device.dtype).to(device.device)
        self.logits = torch.randn(max_rows, model.cfg.vocab_size, generator=g).mul_(3).to(device.device)
        model.logits = lambda hidden: self.logits[:hidden.shape[0]]

        self.slept: list[float] = []        # each forward's real length (a sleep overshoots)

        def forward(input_ids, positions, batch):
            if sleep_s:
                start = time.perf_counter()
                time.sleep(sleep_s)
                self.slept.append(time.perf_counter() - start)
            return self.hidden[:input_ids.shape[0]]
        model.forward = forward


class Phases:
    """Wraps the engine's calls to add up their seconds per step (off until `on`)."""

    def __init__(self, engine: LLMEngine):
        worker = engine.worker("m")
        self.on, self.step = False, defaultdict(float)
        for obj, name, phase in ((worker.scheduler, "schedule", "schedule"), (worker.runner, "prepare", "prepare"),
                                 (worker.runner, "_forward", "forward"), (worker.runner, "run", "run"),
                                 (worker.scheduler, "postprocess", "postprocess"), (engine, "_output", "output")):
            setattr(obj, name, self._timed(getattr(obj, name), phase))

    def _timed(self, fn, phase: str):
        def call(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[phase] += time.perf_counter() - start
        return call

    def take(self, total: float) -> dict[str, float]:
        """This step's seconds per phase; sampling is what run spends outside prepare and the forward."""
        s, self.step = self.step, defaultdict(float)
        out = {p: s[p] for p in PHASES if p != "sampling"}
        out["sampling"] = s["run"] - s["prepare"] - s["forward"]
        out["other"] = total - sum(out.values())
        return out


def sync(engine: LLMEngine) -> None:
    if engine.worker("m").runner.device.device.type == "cuda":
        torch.cuda.synchronize()


def steady(folder: Path, batch: int, steps: int, device: str, stub_ms: float = 0.0, async_scheduling: bool = False,
           path: str = "greedy"):
    """An engine with `batch` requests decoding (the stub in place), and a timed step. `path`:
    greedy requests, or sampled ones through the batched sampler or the per-row one."""
    max_tokens = 2 * steps + 64
    blocks = batch * -(-(PROMPT_TOKENS + max_tokens) // 16) + 16
    # cpu_step off: its compiled decoder would run the real layers past the stubbed forward.
    engine = LLMEngine(EngineConfig(models={"m": ModelEntry(str(folder))}, max_kv_blocks=blocks, memory_budget_gb=2.0,
                                    device=device, cuda_graphs=False, cpu_step=False,
                                    async_scheduling=async_scheduling), progress=False)
    stub = Stub(engine, max(batch, engine.config.max_num_seqs), stub_ms / 1e3)
    vocab = engine.worker("m").cfg.vocab_size
    g = torch.Generator().manual_seed(batch)
    if path == "per_row":
        runner = engine.worker("m").runner
        runner._sample = types.MethodType(legacy_sample, runner)
    for i in range(batch):
        params = (SamplingParams(max_tokens=max_tokens, ignore_eos=True) if path == "greedy" else
                  SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True))
        engine.add_request(torch.randint(0, vocab - 1, (PROMPT_TOKENS,), generator=g).tolist(), params)
    seqs = [seq for _, seq in engine.requests.values()]
    while not all(len(s) > s.num_prompt_tokens for s in seqs):     # every prompt prefilled
        engine.step()
    for _ in range(5):
        engine.step()

    def timed_step() -> float:
        start = time.perf_counter()
        outputs = engine.step()
        sync(engine)
        assert len(outputs) == batch and not any(o.finished for o in outputs)
        return time.perf_counter() - start
    return engine, stub, timed_step


def overlap(folder: Path, batch: int, steps: int, device: str, stub_ms: float) -> dict:
    """Median step wall time with the forward stubbed by a sleep, async scheduling off and on,
    and over the sleep's own median length (on a busy host a sleep overshoots). With it on, then,
    where the host's time goes on its two threads (`threads`)."""
    out = {}
    for mode in ("off", "on"):
        engine, stub, timed_step = steady(folder, batch, steps, device, stub_ms, mode == "on")
        stub.slept.clear()
        ms = statistics.median(timed_step() for _ in range(steps)) * 1e3
        forward_ms = statistics.median(stub.slept) * 1e3
        out[mode] = {"ms_per_step": ms, "forward_ms": forward_ms, "ratio": ms / forward_ms}
    out["on"] |= threads(engine, timed_step, steps)
    return out


def threads(engine: LLMEngine, timed_step, steps: int) -> dict:
    """Medians per step, async scheduling on, in wall time (waits for the GIL included): the main
    thread's work (schedule, prepare, postprocess, outputs) and the runner thread's beyond its
    forward (sampling, the read-back, the outputs' records). One GIL runs both, so the overlap
    hides the forward behind the host's Python work only where that work is shorter."""
    phases, runner, busy = Phases(engine), engine.worker("m").runner, []
    execute = runner._execute

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            busy.append(time.perf_counter() - start)
    runner._execute = timed         # launch() looks it up per step
    phases.on = True
    main, beyond = [], []
    for _ in range(steps):
        busy.clear()
        p = phases.take(timed_step())
        main.append(p["schedule"] + p["prepare"] + p["postprocess"] + p["output"])
        beyond.append(sum(busy) - p["forward"])
    return {"main_thread_ms": statistics.median(main) * 1e3,
            "runner_beyond_forward_ms": statistics.median(beyond) * 1e3}


def measure(folder: Path, batch: int, steps: int, device: str, path: str = "greedy") -> dict:
    engine, stub, timed_step = steady(folder, batch, steps, device, path=path)
    phases = Phases(engine)
    totals = [timed_step() for _ in range(steps)]
    phases.on = True
    per_phase = [phases.take(timed_step()) for _ in range(steps)]
    # The reference pass: a log-softmax over this step's logits rows.
    rows, out = stub.logits[:batch], torch.empty_like(stub.logits[:batch])
    reference = []
    for _ in range(steps):
        start = time.perf_counter()
        torch.log_softmax(rows, -1, out=out)
        sync(engine)
        reference.append(time.perf_counter() - start)
    step_s = statistics.median(totals)
    return {"ms_per_step": step_s * 1e3, "us_per_seq": step_s * 1e6 / batch,
            "phases_ms": {p: statistics.median(s[p] for s in per_phase) * 1e3 for p in (*PHASES, "other")},
            "log_softmax_pass_ms": statistics.median(reference) * 1e3}


def verdicts(forms: dict, vocabs: list[int]) -> list[dict]:
    """Each target, met or missed. A larger vocabulary's passes over the logits: what it adds
    to sampling over the bookkeeping form's, in reference passes."""
    small, out = forms[str(vocabs[0])], []
    for batch, limit in TARGET_MS.items():
        if str(batch) in small:
            got = small[str(batch)]["ms_per_step"]
            out.append({"target": f"bookkeeping at batch {batch} <= {limit * 1e3:.0f} µs", "measured_us": got * 1e3,
                        "met": got <= limit})
    for vocab in vocabs[1:]:
        for batch, r in forms[str(vocab)].items():
            passes = (r["phases_ms"]["sampling"] - small[batch]["phases_ms"]["sampling"]) / r["log_softmax_pass_ms"]
            r["logits_passes"] = passes
            out.append({"target": f"one pass over {vocab:,} logits at batch {batch}", "measured_passes": passes,
                        "met": round(passes) <= 1})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="steps timed per form and batch (medians)")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS), help="the first is the bookkeeping form")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the stub's tensors live there too)")
    ap.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own choice)")
    ap.add_argument("--stub-ms", type=float, nargs="*", default=list(STUB_MS),
                    help="the overlap rows' forward lengths (none: skip them)")
    ap.add_argument("--sampled-batches", type=int, nargs="*", default=list(SAMPLED_BATCHES),
                    help="the sampled rows' batches (none: skip them)")
    ap.add_argument("--sampled-steps", type=int, default=SAMPLED_STEPS, help="steps timed per sampled row")
    ap.add_argument("--out", type=Path, default=RESULTS / "step_overhead.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    results: dict = {"machine": machine() | {"device": device}, "steps": args.steps,
                     "prompt_tokens": PROMPT_TOKENS, "forms": {}, "overlap": {}, "sampled": {},
                     "sampled_steps": args.sampled_steps}
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocabs:
            folder = model_folder(Path(tmp), vocab)
            for batch in args.batches:
                console.print(f"vocabulary {vocab:,}, batch {batch}")
                results["forms"].setdefault(str(vocab), {})[str(batch)] = measure(folder, batch, args.steps,
                                                                                   args.device)
            for batch in args.sampled_batches:
                for path in PATHS:
                    console.print(f"vocabulary {vocab:,}, batch {batch}, {path.replace('_', '-')}")
                    results["sampled"].setdefault(str(vocab), {}).setdefault(str(batch), {})[path] = measure(
                        folder, batch, args.sampled_steps, args.device, path)
            if vocab == args.vocabs[0]:
                for stub_ms in args.stub_ms:
                    for batch in OVERLAP_BATCHES:
                        console.print(f"overlap: forward {stub_ms:g} ms, batch {batch}")
                        results["overlap"].setdefault(f"{stub_ms:g}", {})[str(batch)] = overlap(
                            folder, batch, args.steps, args.device, stub_ms)
    table = Table(title=f"Host work per decode step, model stubbed ({args.device}, {torch.get_num_threads()} "
                        f"threads, median of {args.steps} steps; phases in ms, from the instrumented run)")
    for col in ("vocabulary", "batch", "ms / step", "µs / seq", *PHASES, "other"):
        table.add_column(col, justify="right")
    for vocab, by_batch in results["forms"].items():
        for batch, r in by_batch.items():
            table.add_row(f"{int(vocab):,}", batch, f"{r['ms_per_step']:.3f}", f"{r['us_per_seq']:.0f}",
                          *(f"{r['phases_ms'][p]:.3f}" for p in (*PHASES, "other")))
    console.print(table)

    if results["overlap"]:
        table = Table(title=f"Step wall time with the forward a {', '.join(f'{m:g}' for m in args.stub_ms)} ms sleep "
                            f"(vocabulary {args.vocabs[0]:,}, median of {args.steps} steps): async scheduling off, on")
        for col in ("sleep ms", "batch", "off: ms / step", "its forward", "off / forward", "on: ms / step",
                    "its forward", "on / forward", "on: main thread", "runner beyond forward"):
            table.add_column(col, justify="right")
        for stub_ms, by_batch in results["overlap"].items():
            for batch, r in by_batch.items():
                table.add_row(stub_ms, batch, *(f"{r[m][k]:.2f}{'x' if k == 'ratio' else ''}" for m in ("off", "on")
                                                for k in ("ms_per_step", "forward_ms", "ratio")),
                              f"{r['on']['main_thread_ms']:.2f}", f"{r['on']['runner_beyond_forward_ms']:.2f}")
        console.print(table)

    if results["sampled"]:
        table = Table(title=f"Sampled steps (temperature 0.8, top_p 0.95, seeded) against the same steps greedy "
                            f"(median of {args.sampled_steps} steps; ms per step, sampling phase in brackets)")
        for col in ("vocabulary", "batch", "greedy", "sampled: batched", "sampled: per-row", "per-row / batched",
                    "its sampling phase"):
            table.add_column(col, justify="right")
        for vocab, by_batch in results["sampled"].items():
            for batch, r in by_batch.items():
                cells = [f"{r[p]['ms_per_step']:.2f} ({r[p]['phases_ms']['sampling']:.2f})" for p in PATHS]
                r["per_row_over_batched"] = r["per_row"]["ms_per_step"] / r["batched"]["ms_per_step"]
                r["per_row_over_batched_sampling"] = (r["per_row"]["phases_ms"]["sampling"]
                                                      / r["batched"]["phases_ms"]["sampling"])
                table.add_row(f"{int(vocab):,}", batch, *cells, f"{r['per_row_over_batched']:.2f}x",
                              f"{r['per_row_over_batched_sampling']:.2f}x")
        console.print(table)

    results["targets"] = verdicts(results["forms"], args.vocabs) + [
        {"target": f"step <= {TARGET_RATIO:.2f}x a {stub_ms} ms forward at batch {batch}, async scheduling on",
         "measured_ratio": r["on"]["ratio"], "met": r["on"]["ratio"] <= TARGET_RATIO}
        for stub_ms, by_batch in results["overlap"].items() for batch, r in by_batch.items()]
    targets = Table(title="Targets (issues 35 and 53)")
    for col in ("target", "measured", ""):
        targets.add_column(col)
    for v in results["targets"]:
        measured = f"{v['measured_us']:.0f} µs" if "measured_us" in v else f"{v['measured_passes']:.2f} passes" \
            if "measured_passes" in v else f"{v['measured_ratio']:.2f}x"
        targets.add_row(v["target"], measured, "[green]met[/]" if v["met"] else "[red]missed[/]")
    console.print(targets)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
