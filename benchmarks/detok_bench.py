"""Output processing per token of a 2,000-token answer: before (the engine until this change
decoded the whole answer again at every step, and built two sets per token for its stop
check) against after (incremental detokenization, stop strings searched in the new text and
the held-back tail only, the stop check on the request's resolved stop ids).

The old algorithm is kept here, as it was, as the baseline. Both run on the same token stream
(real text with multi-byte characters, one token per step, two stop strings that never
match so every step searches) and must give the same text as decoding the answer at once.
Uses the Qwen tokenizer when it is cached, else SmolLM2's. Prints a table of per-token costs
at points along the answer with their ratios and writes benchmarks/results/detok_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import RESULTS, machine
from rich.console import Console
from rich.table import Table

from engine.config import ModelConfig, ThinkingConfig
from engine.detokenizer import Detokenizer
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, Status
from engine.stop_checker import StopChecker
from engine.tokenizer import Tokenizer
from models.store import cache_dir, resolve

console = Console(width=120)
TEXT = ("The lighthouse keeper wrote in his log: « La mer était calme, 風は穏やか » — the sea was calm, "
        "the wind gentle 🌊⛵. He counted 42 ships, ½ of them bound for Zürich's lake port (¡no, Basel!). ")
STOPS = ["\n\nQuestion:", "</answer>"]


def tokenizer() -> tuple[str, Path]:
    for name in ("qwen2.5-coder-0.5b", "smollm2-135m"):
        if (cache_dir() / "models" / name / ".sluice-complete").exists():
            return name, resolve(name, progress=False)
    return "smollm2-135m", resolve("smollm2-135m")


# ---- before: the engine's output step as it was (scheduler's stop check, llm_engine._emit) ---
class OldStopCheck:
    """Scheduler.stop_ids, _finish_reason and postprocess's loop over a step's tokens as they
    were: two sets built per token."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int):
        self.eos_token_ids, self.max_model_len = set(eos_token_ids), max_model_len

    def stop_ids(self, seq: Sequence) -> set[int]:
        return set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)

    def finish_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        answer_start = seq.answer_start
        if answer_start is not None and token in self.stop_ids(seq):
            return "stop"
        if answer_start is not None and length - answer_start >= seq.params.max_tokens:
            return "length"
        return "length" if length >= self.max_model_len else None

    def check(self, seq: Sequence, tokens: list[int]) -> str | None:
        """After the step appended `tokens`."""
        base = len(seq) - len(tokens)
        for i, token in enumerate(tokens):
            reason = self.finish_reason(seq, token, base + i + 1)
            if reason:
                return reason
        return None


def old_emit(tok: Tokenizer, seq: Sequence, output_text: str) -> tuple[str, str]:
    stops = seq.params.stop
    text = tok.decode(seq.token_ids[seq.num_prompt_tokens:])
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        text = text[:cut]
    elif not seq.is_finished:
        hold = max((len(s) - 1 for s in stops), default=0)
        text = text.rstrip("\ufffd")
        text = text[:max(len(output_text), len(text) - hold)]
    return text[len(output_text):], text


def run_old(tok: Tokenizer, stop: StopChecker, prompt: list[int], answer: list[int], params: SamplingParams):
    seq, text, costs = Sequence(list(prompt), params), "", []
    old = OldStopCheck(stop.eos_ids, stop.max_model_len)
    for t in answer:
        start = time.perf_counter_ns()
        seq.token_ids.append(t)
        assert old.check(seq, [t]) is None
        _, text = old_emit(tok, seq, text)
        costs.append(time.perf_counter_ns() - start)
    seq.status = Status.FINISHED            # the last output flushes what was held back
    return old_emit(tok, seq, text)[1], costs


# ---- after: this engine's stop checker and detokenizer --------------------------------
def run_new(tok: Tokenizer, stop: StopChecker, prompt: list[int], answer: list[int], params: SamplingParams):
    seq = Sequence(list(prompt), params, stop_ids=stop.stop_ids(params))
    detok, costs = Detokenizer(tok, len(prompt)), []
    for t in answer:
        start = time.perf_counter_ns()
        first = len(seq)
        seq.token_ids.append(t)
        assert stop.check(seq, first) is None
        delta, stopped = stop.check_text(seq, detok.update(seq.token_ids))
        seq.text.append(delta)
        costs.append(time.perf_counter_ns() - start)
    seq.status = Status.FINISHED
    seq.text.append(stop.check_text(seq, detok.update(seq.token_ids, final=True))[0])
    return "".join(seq.text), costs


def stop_check_ns(stop: StopChecker, prompt: list[int], answer: list[int], params: SamplingParams) -> dict:
    """The per-token stop check alone, before (two sets built per token) and after."""
    seq = Sequence(list(prompt) + answer, params, stop_ids=stop.stop_ids(params))
    seq.num_prompt_tokens = len(prompt)
    old, n, last = OldStopCheck(stop.eos_ids, stop.max_model_len), len(seq), answer[-1:]
    runs = [(_timed(lambda: old.check(seq, last)), _timed(lambda: stop.check(seq, n - 1)))
            for _ in range(15)]          # interleaved, so a busy machine slows both alike
    return {"before_ns": min(r[0] for r in runs), "after_ns": min(r[1] for r in runs)}


def _timed(fn, calls: int = 20000) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5, help="runs of each; per-token costs are the minimum")
    ap.add_argument("--out", type=Path, default=RESULTS / "detok_bench.json")
    args = ap.parse_args()
    name, folder = tokenizer()
    tok = Tokenizer(folder)
    stop = StopChecker(ModelConfig.from_folder(folder), tok, ThinkingConfig(), 10**9)
    prompt = tok.encode("Write the keeper's log.\n")
    answer = (tok.encode(TEXT) * (args.tokens // len(tok.encode(TEXT)) + 1))[:args.tokens]
    params = SamplingParams(max_tokens=args.tokens + 1, stop=STOPS)
    whole = tok.decode(answer)
    costs = {}
    for label, run in (("before", run_old), ("after", run_new)):
        runs = []
        for _ in range(args.repeats):
            text, c = run(tok, stop, prompt, answer, params)
            assert text == whole, f"{label}: the streamed text differs from decoding the answer at once"
            runs.append(c)
        costs[label] = [min(c) for c in zip(*runs)]
    points = [p for p in (1, 10, 100, 500, 1000, 2000, args.tokens) if p <= args.tokens]
    window = 10      # each point: the mean cost of the tokens just before it

    def at(label: str, p: int) -> float:
        return statistics.mean(costs[label][max(0, p - window):p]) / 1e3

    rows = [{"token": p, "before_us": at("before", p), "after_us": at("after", p)} for p in sorted(set(points))]
    totals = {k: sum(v) / 1e6 for k, v in costs.items()}
    table = Table(title=f"Output processing per token ({name} tokenizer, {args.tokens}-token answer, "
                        f"stop strings {STOPS}; µs, mean of the {window} tokens up to each point)")
    for col in ("token", "before µs", "after µs", "before / after"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["token"]), f"{r['before_us']:.1f}", f"{r['after_us']:.1f}",
                      f"{r['before_us'] / r['after_us']:.1f}x")
    table.add_row("whole answer", f"{totals['before']:.1f} ms", f"{totals['after']:.1f} ms",
                  f"{totals['before'] / totals['after']:.1f}x")
    check = stop_check_ns(stop, prompt, answer, params)
    table.add_row("stop check alone", f"{check['before_ns'] / 1e3:.2f}", f"{check['after_ns'] / 1e3:.2f}",
                  f"{check['before_ns'] / check['after_ns']:.1f}x")
    console.print(table)
    result = {"machine": machine(), "tokenizer": name, "tokens": args.tokens, "stops": STOPS, "repeats": args.repeats,
              "per_token_us": rows, "total_ms": totals, "stop_check_ns": check,
              "growth_last_over_first_100": {k: at(k, args.tokens) / at(k, 100) for k in costs}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
