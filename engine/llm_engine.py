"""The engine: one object holding every served model (small and large) under one memory
budget, and one step loop over all of them, split as vLLM v1 splits it: input processing
(add_request), the core (schedule -> run -> postprocess), output processing (incremental
detokenization, stop strings, completions)."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import kernels
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.early_exit import Prober
from engine.prompter import Prompter
from engine.quantize import dot_vnni
from engine.sampling_params import SamplingParams
from engine.sequence import KVWindow, Probe, Sequence, SpecState, isolated
from engine.speculative import Speculator
from engine.step import RunnerOutput, ScheduledSeq, SchedulerOutput
from engine.worker import Worker, load_workers, resolve_quant, weight_bytes


@dataclass
class Completion:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    num_cached_tokens: int
    ttft: float          # seconds from arrival to the first token
    latency: float
    thinking_text: str = ""
    num_thinking_tokens: int = 0   # inside the span, within the budget; forced markers not counted
    error: str | None = None       # why the request failed (finish_reason "error"); others went on
    engine_s: float = 0.0          # its share of the steps it was in the engine for (each split evenly)
    num_evicted_tokens: int = 0    # tokens its KV window dropped from the cache (0: none, or no window)
    probes: list[Probe] = field(default_factory=list)     # early exit's looks at the answer, in order
    thinking_exited: bool = False  # its thinking ended early: the answer had settled

    @property
    def num_probe_tokens(self) -> int:
        """What its probes cost (an answer taken from one counts as the answer)."""
        return sum(p.tokens for p in self.probes if not p.taken)

    @property
    def num_billed_tokens(self) -> int:
        """Output tokens as billed: every token it generated, and its probes'."""
        return len(self.token_ids) + self.num_probe_tokens


@dataclass
class StepOutput:
    """What one step produced for one request: new tokens and the text they complete.
    The last output of a request carries its whole completion."""
    request_id: str
    model: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text_delta: str
    num_cached_tokens: int = 0     # prompt tokens the prefix cache served, known from the first output
    completion: Completion | None = None

    @property
    def finished(self) -> bool:
        return self.completion is not None


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        """Loads every model named in the config through the model store."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        config = resolve_quant(config)
        self.config = config
        self.workers = load_workers(config, progress)
        self.requests: dict[str, tuple[Worker, Sequence]] = {}
        self.probers = {name: Prober(worker) for name, worker in self.workers.items()}
        spec = config.speculative
        self.speculator = Speculator(spec, self.workers[spec.target], self.workers.get(spec.draft)) if spec else None
        self.async_scheduling = config.async_scheduling and spec is None
        # Async scheduling: per model, the step launched and not yet postprocessed.
        self.in_flight: dict[str, tuple[SchedulerOutput, Future[RunnerOutput]]] = {}
        if self.async_scheduling:
            for worker in self.workers.values():
                worker.runner.start_queue()

    # ---- input processing ----------------------------------------------------------------
    def worker(self, model: str | None) -> Worker:
        name = model or next(iter(self.workers))
        if name not in self.workers:
            raise ValueError(f"unknown model {name!r}; this engine serves: {', '.join(self.workers)}")
        return self.workers[name]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, model: str | None = None,
                    salt: bytes = b"", request_id: str | None = None, speculate: bool = True,
                    draft: list[int] | None = None, window: KVWindow | None = None) -> str:
        """Queue a request; bad input raises ValueError and leaves the engine untouched.
        `draft` is an external draft of the continuation (say, a small model's answer) that the
        target verifies instead of generating from scratch; the output is unchanged by it.
        `window`: keep only its sinks and recent tokens in the KV cache (StreamingLLM)."""
        worker = self.worker(model)
        self._check_window(worker, window)
        ids = worker.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        params = params or SamplingParams()
        for what, tokens in (("prompt", ids), ("stop_token_ids", params.stop_token_ids)):
            if any(not 0 <= t < worker.cfg.vocab_size for t in tokens):
                raise ValueError(f"{what} has token ids outside the vocabulary (0..{worker.cfg.vocab_size - 1})")
        thinking = None
        if params.max_thinking_tokens or worker.thinking.native:    # a native thinker is told not to, at 0
            ids, thinking = worker.stop.open_span(ids, params.max_thinking_tokens)
        seq = Sequence(ids, params, salt=salt, request_id=request_id or "", stop_ids=worker.stop.stop_ids(params),
                       thinking=thinking, window=window)
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if draft and not (self.speculator and worker is self.speculator.target):
            raise ValueError(f"an external draft needs speculative decoding configured with {worker.name!r} as target")
        if self.speculator and worker is self.speculator.target and speculate:
            seq.spec = SpecState(external=list(draft or []))
        worker.scheduler.add(seq)
        self.requests[seq.request_id] = (worker, seq)
        return seq.request_id

    def _check_window(self, worker: Worker, window: KVWindow | None) -> None:
        if window is not None and (errors := window.errors(self.config.block_size, worker.scheduler.max_model_len)):
            raise ValueError("bad KV window: " + "; ".join(f"{key} {message}" for key, message in errors))

    def prompter(self, model: str | None = None) -> Prompter:
        """What composing `model`'s prompts needs: tokenizer, chat template, context length."""
        return self.worker(model).prompter

    def verifies_drafts(self, model: str) -> bool:
        """Whether `model` takes an external draft (add_request's `draft`) to verify."""
        return self.speculator is not None and self.speculator.target.name == model

    def memory_plan(self) -> str:
        """What the memory budget holds, for the start-up log: each model's weights and KV blocks."""
        config = self.config
        return f"memory budget {config.memory_budget_gb:g} GiB: " + "; ".join(
            f"{name}: {w.memory(config.block_size, config.models[name].quant)}"
            for name, w in self.workers.items())

    def abort(self, request_id: str) -> Completion | None:
        """Drop a request wherever it is; its KV blocks go back at once. Returns what it had
        produced (finish_reason "abort"); None for a request the engine does not hold."""
        if request_id not in self.requests:
            return None
        worker, seq = self.requests[request_id]
        self.probers[worker.name].drop(seq)
        worker.scheduler.finish(seq, "abort")
        return self._completion(worker, seq)

    def has_work(self) -> bool:
        return bool(self.in_flight) or any(w.scheduler.waiting or w.scheduler.running for w in self.workers.values())

    # ---- the core, then output processing ------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step of every model. With async scheduling, a model's step N + 1 is planned and
        launched while step N runs, and the outputs returned are step N's."""
        start, present = time.perf_counter(), [seq for _, seq in self.requests.values()]
        outputs = []
        for worker in self.workers.values():
            spec = self.speculator if self.speculator and worker is self.speculator.target else None
            sched = worker.scheduler.schedule(spec.propose() if spec else None)
            if self.async_scheduling:
                sched, out = self._overlap(worker, sched)
            elif sched:
                out = spec.run_target(sched) if spec else worker.runner.run(sched)
            if sched:
                prober = self.probers[worker.name]
                for seq, length, logprobs in worker.scheduler.postprocess(sched, out):
                    if seq.probe_of is not None:
                        if (took := prober.read(seq)) is not None:        # its request answered with it
                            outputs.append(self._output(worker, *took))
                        continue
                    outputs.append(self._output(worker, seq, length, logprobs))
                    prober.after_step(seq)
        if present:
            share = (time.perf_counter() - start) / len(present)
            for seq in present:
                seq.engine_s += share
            for out in outputs:          # finished in this step: their completions were made before its end
                if out.completion is not None:
                    out.completion.engine_s += share
        return outputs

    def _overlap(self, worker: Worker, sched: SchedulerOutput) -> tuple[SchedulerOutput | None, RunnerOutput | None]:
        """Launch this step, then wait for the one before it (the device has this one queued
        meanwhile): that one's records. A step that fails as a whole leaves nothing in flight."""
        before = self.in_flight.pop(worker.name, None)
        try:
            if sched:
                self.in_flight[worker.name] = (sched, worker.runner.launch(sched))
            return (before[0], before[1].result()) if before else (None, None)
        except BaseException:
            self.in_flight.pop(worker.name, None)
            worker.scheduler.in_flight.clear()
            raise

    def _output(self, worker: Worker, seq: Sequence, length: int, logprobs: list[float]) -> StepOutput:
        """One request after a step: its new tokens (after any finish or forcing), the answer
        text they complete (the span's too, with include_thinking) up to a stop string, which
        finishes it, and once it is finished its completion."""
        new = seq.token_ids[length:]
        seq.first_token_time = seq.first_token_time or time.monotonic()
        delta, start = "", seq.num_prompt_tokens if seq.params.include_thinking else seq.answer_start
        with isolated(seq):
            if start is not None:
                seq.detokenizer = seq.detokenizer or Detokenizer(worker.tokenizer, start)
                text = seq.detokenizer.update(seq.token_ids, final=seq.is_finished)
                delta, stopped = worker.stop.check_text(seq, text)
                seq.text.append(delta)
                if stopped:
                    worker.scheduler.finish(seq, "stop")
        if seq.error:     # finished alone; what it wrote may hold NaNs, so its blocks are zeroed
            worker.runner.clear(worker.scheduler.finish(seq, "error"))
        return StepOutput(seq.request_id, worker.name, new, logprobs, delta, seq.num_cached_tokens,
                          self._completion(worker, seq) if seq.is_finished else None)

    def _completion(self, worker: Worker, seq: Sequence) -> Completion:
        """The engine forgets the request now; its blocks are already free."""
        del self.requests[seq.request_id]
        if self.speculator:
            self.speculator.release(seq)
        th, now = seq.thinking, time.monotonic()
        n_think = th.num_tokens(len(seq)) if th else 0
        n = seq.num_prompt_tokens
        return Completion(seq.request_id, worker.name, seq.token_ids[:n], seq.token_ids[n:],
                          "".join(seq.text), list(seq.logprobs), seq.finish_reason or "", seq.num_cached_tokens,
                          (seq.first_token_time or now) - seq.arrival, now - seq.arrival,
                          worker.tokenizer.decode(seq.token_ids[th.start:th.start + n_think]) if th else "",
                          n_think, seq.error, seq.engine_s, seq.num_evicted,
                          list(th.probes) if th else [], th is not None and th.exited)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 model: str | None = None, salt: bytes = b"", progress: bool = False) -> list[Completion]:
        """Batch use: run all prompts to completion with continuous batching."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp, model=model, salt=salt) for p, sp in zip(prompts, params_list)]
        done: dict[str, Completion] = {}
        with tqdm(total=len(ids), disable=not progress, desc="generate") as bar:
            while len(done) < len(ids):
                for out in self.step():
                    if out.completion and out.request_id in ids:
                        done[out.request_id] = out.completion
                        bar.update(1)
        return [done[i] for i in ids]

    def score(self, token_ids: list[int], model: str | None = None, first: int = 1,
              window: KVWindow | None = None, chunk: int | None = None) -> list[float]:
        """Log-probability of each token from index `first` on, given the ones before it
        (perplexity, answer likelihoods: `first` = the prompt's length). Positions the prefix
        cache already holds are not computed again, and the LM head runs only where a score is
        asked for, so references scored after a shared prompt cost their own tokens.
        Synchronous: call it between steps, not during one. Chunks of `chunk` tokens (default
        max_num_batched_tokens); with a `window`, a chunk sees its first token's window and
        itself."""
        worker = self.worker(model)
        self._check_window(worker, window)
        bm, chunk = worker.block_manager, chunk or self.config.max_num_batched_tokens
        seq = Sequence(list(token_ids), SamplingParams(max_tokens=1), salt=b"score", window=window)
        if len(seq) < 2 or len(seq) >= worker.scheduler.max_model_len:
            raise ValueError(f"score needs 2 to {worker.scheduler.max_model_len - 1} tokens, got {len(seq)}")
        if not 1 <= first < len(seq):
            raise ValueError(f"score: first must be 1 to {len(seq) - 1} (a token with one before it), got {first}")
        full = window is None
        if not bm.can_allocate(seq, len(seq) if full else min(len(seq), window.size + chunk)):
            raise ValueError("not enough free KV blocks to score this sequence now")
        bm.allocate(seq, None if full else 0)
        out: list[float] = []
        try:
            # The position before `first` predicts it, so that one is computed even when cached.
            # The last token predicts nothing, so its position is never computed.
            for start in range(min(seq.num_cached_tokens, first - 1), len(seq) - 1, chunk):
                n = min(len(seq) - 1 - start, chunk)
                shift = bm.evict(seq, start)
                if shift is None or not bm.resize(seq, len(seq) if full else start + n):
                    raise ValueError("not enough free KV blocks to score this sequence now")
                out += worker.runner.logprobs(ScheduledSeq(seq, start, n, False, shift=shift),
                                              max(first - 1 - start, 0)).tolist()
                bm.register_computed(seq, start + n)
        finally:
            bm.free_seq(seq)
        return out

    def stats(self) -> dict[str, dict]:
        out = {name: {"running": len(w.scheduler.running), "waiting": len(w.scheduler.waiting),
                      "kv_blocks_total": len(w.block_manager.blocks), "kv_blocks_free": w.block_manager.num_free,
                      "prefix_cache_queries": w.block_manager.queries, "prefix_cache_hits": w.block_manager.hits,
                      "preemptions": w.scheduler.num_preemptions, "device": str(w.runner.device.device),
                      "async_scheduling": self.async_scheduling, "scheduled_ahead": w.scheduler.num_ahead,
                      "discarded_outputs": w.scheduler.num_discarded,
                      "cuda_graph_batch_sizes": w.runner.graphs.buckets if w.runner.graphs else [],
                      "kernel_fallbacks": sorted(kernels.FALLBACKS),
                      "cpu_kernels": w.runner.cpu_ops is not None,
                      "cpu_steps": w.runner.cpu_step.steps if w.runner.cpu_step else 0,
                      "quant": self.config.models[name].quant, "gguf_steps": self.config.models[name].gguf_steps,
                      "gguf_steps_on": list(self.config.models[name].gguf_steps_on),
                      "weight_bytes": weight_bytes(w.model),
                      "dequant_rows": w.dequant_rows, "dot_rows": w.dot_rows, "dense_buckets": list(w.dense_buckets),
                      "gemv_buckets": {kind: list(b) for kind, b in w.gemv_buckets.items()},
                      "dot_vnni": w.dot_rows > 0 and w.runner.device.device.type == "cpu" and dot_vnni(),
                      "thinking_probes": self.probers[name].num_probes,
                      "thinking_probe_tokens": self.probers[name].num_probe_tokens,
                      "thinking_early_exits": self.probers[name].num_exits}
               for name, w in self.workers.items()}
        if self.speculator:
            spec = self.speculator
            out[spec.target.name]["speculation"] = spec.stats.as_dict() | {
                "governor": spec.governor.as_dict() if spec.governor else None,
                "draft_vocab": len(spec.draft_vocab.ids) if spec.draft_vocab else None}
        return out
