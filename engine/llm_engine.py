"""The engine: one object holding every served model (small and large) under one memory
budget, and one step loop over all of them."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, SpecConfig, ThinkingConfig
from engine.model import CausalLM, load_model
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.quantize import apply_quantization
from engine.sequence import Sequence, isolated
from engine.speculative import SpecState, Speculator
from models.store import derived_path, resolve
from engine.thinking import advance, answer_bans, open_span
from engine.tokenizer import Tokenizer


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


@dataclass
class StepOutput:
    """What one step produced for one request: new tokens and the text they complete.
    The last output of a request carries its whole completion."""
    request_id: str
    model: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text_delta: str
    completion: Completion | None = None

    @property
    def finished(self) -> bool:
        return self.completion is not None


@dataclass
class Worker:
    """One model with everything that is per model: weights, tokenizer, KV, queues."""
    name: str
    cfg: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    thinking: ThinkingConfig


def weight_bytes(model: CausalLM, per_token: bool = False) -> int:
    """Bytes of the model's weights as loaded (quantized ones included). per_token: the bytes
    a decode step reads, which leaves out the embedding table (one row of it is read)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if per_token:
        total -= sum(t.numel() * t.element_size() for t in [*model.embed_tokens.parameters(),
                                                            *model.rotary.buffers()])
    return total


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        """Loads every model named in the config through the model store."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        loaded = {}
        for name, entry in config.models.items():
            folder = resolve(entry.source, progress=progress)
            cfg = ModelConfig.from_folder(folder)
            cache = derived_path(folder, f"{entry.quant}-g{entry.group_size}.safetensors")
            quantized = entry.quant != "none" and cache.exists()    # no float weights to read
            model = load_model(folder, cfg, linear_weights=not quantized)
            if entry.quant != "none":
                model = apply_quantization(model, entry.quant, entry.group_size, cache)
            loaded[name] = (cfg, model, Tokenizer(folder))
        self.workers = self._size_kv(config, loaded)
        self.requests: dict[str, tuple[Worker, Sequence]] = {}
        self.speculator = self._speculator(config.speculative)

    def _speculator(self, spec: SpecConfig | None) -> Speculator | None:
        if spec is None:
            return None
        target, draft = self.workers[spec.target], spec.draft and self.workers[spec.draft]
        if draft and draft.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
            raise ValueError(f"draft model {spec.draft!r} cannot draft for {spec.target!r}: their tokenizers differ")
        return Speculator(spec, target, draft or None)

    @staticmethod
    def _size_kv(config: EngineConfig, loaded: dict) -> dict[str, Worker]:
        weights = sum(weight_bytes(m) for _, m, _ in loaded.values())
        free = config.memory_budget_gb * 2**30 - weights
        if free <= 0:
            raise ValueError(f"memory_budget_gb={config.memory_budget_gb} does not even hold the weights "
                             f"({weights / 2**30:.2f} GiB); raise it")
        shares = sum(config.models[n].kv_share for n in loaded)
        workers = {}
        for name, (cfg, model, tok) in loaded.items():
            kv_int8 = config.kv_cache_dtype == "int8"
            per_block = ModelRunner.kv_bytes_per_block(cfg, config.block_size, kv_int8)
            blocks = int(free * config.models[name].kv_share / shares // per_block)
            if config.max_kv_blocks:
                blocks = min(blocks, config.max_kv_blocks)
            if blocks < 2:
                raise ValueError(f"memory budget leaves {blocks} KV blocks for model {name!r}; raise memory_budget_gb")
            bm = BlockManager(blocks, config.block_size, config.prefix_caching)
            eos = set(cfg.eos_token_ids) | {i for i in (tok.token_id(t) for t in (tok.eos_token,) if t) if i is not None}
            sched = Scheduler(bm, cfg.max_position, config.max_num_batched_tokens, config.max_num_seqs,
                              config.max_wait_steps, tuple(sorted(eos)))
            thinking = config.models[name].thinking

            def bans(seq: Sequence, i: int, sched=sched, thinking=thinking, tok=tok) -> list[int]:
                return answer_bans(seq.token_ids, i, seq.thinking, sorted(sched.stop_ids(seq)), thinking, tok,
                                   committed=len(seq.token_ids) - len(seq.draft))
            runner = ModelRunner(model, cfg, blocks, config.block_size, kv_int8, bans)
            workers[name] = Worker(name, cfg, model, tok, bm, sched, runner, thinking)
        return workers

    # ---- requests -------------------------------------------------------------------
    def worker(self, model: str | None) -> Worker:
        name = model or next(iter(self.workers))
        if name not in self.workers:
            raise ValueError(f"unknown model {name!r}; this engine serves: {', '.join(self.workers)}")
        return self.workers[name]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, model: str | None = None,
                    salt: bytes = b"", request_id: str | None = None, speculate: bool = True,
                    draft: list[int] | None = None) -> str:
        """Queue a request; bad input raises ValueError and leaves the engine untouched.
        `draft` is an external draft of the continuation (say, a small model's answer) that the
        target verifies instead of generating from scratch; the output is unchanged by it."""
        worker = self.worker(model)
        ids = worker.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        params = params or SamplingParams()
        for what, tokens in (("prompt", ids), ("stop_token_ids", params.stop_token_ids)):
            if any(not 0 <= t < worker.cfg.vocab_size for t in tokens):
                raise ValueError(f"{what} has token ids outside the vocabulary (0..{worker.cfg.vocab_size - 1})")
        thinking = None
        if params.thinking_budget is not None:
            ids, thinking = open_span(ids, params.thinking_budget, worker.thinking, worker.tokenizer)
        seq = Sequence(ids, params, salt=salt, request_id=request_id or "")
        seq.thinking = thinking
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if draft and not (self.speculator and worker is self.speculator.target):
            raise ValueError(f"an external draft needs speculative decoding configured with {worker.name!r} as target")
        if self.speculator and worker is self.speculator.target and speculate:
            seq.spec = SpecState(external=list(draft or []))
        worker.scheduler.add(seq)
        self.requests[seq.request_id] = (worker, seq)
        return seq.request_id

    def chat_prompt(self, messages: list[dict], model: str | None = None, thinking: bool = False) -> str:
        """The model's chat template over `messages`; with `thinking` and a model that does not
        think natively, the system message also asks for a thinking span."""
        worker = self.worker(model)
        if thinking and not worker.thinking.native:
            instruction = worker.thinking.instruction
            if messages and messages[0].get("role") == "system":
                messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{instruction}"}] + messages[1:]
            else:
                messages = [{"role": "system", "content": instruction}] + messages
        return worker.tokenizer.apply_chat_template(messages)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its KV blocks go back at once."""
        entry = self.requests.pop(request_id, None)
        if entry:
            entry[0].scheduler.finish(entry[1], "abort")
            if self.speculator:
                self.speculator.release(entry[1])

    def sequence(self, request_id: str) -> Sequence:
        return self.requests[request_id][1]

    def has_work(self) -> bool:
        return any(w.scheduler.has_work() for w in self.workers.values())

    # ---- the step loop --------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = []
        spec = self.speculator
        for worker in self.workers.values():
            speculating = spec is not None and worker is spec.target
            if speculating:
                spec.propose()
            scheduled = worker.scheduler.schedule()
            if not scheduled:
                continue
            lengths = {item.seq.seq_id: len(item.seq) - item.num_draft for item in scheduled}
            start = time.perf_counter()
            sampled = worker.runner.run(scheduled)
            if speculating:
                spec.observe_target_step(time.perf_counter() - start, scheduled, sampled)
                for item in scheduled:
                    if item.seq.seq_id in sampled:
                        spec.observe(item, sampled[item.seq.seq_id][0])
            worker.scheduler.postprocess(scheduled, {sid: tokens for sid, (tokens, _) in sampled.items()})
            now = time.monotonic()
            for item in scheduled:
                seq = item.seq
                if seq.seq_id in sampled or seq.error:
                    with isolated(seq):
                        if seq.thinking and seq.thinking.end is None and not seq.is_finished and not seq.error:
                            act = advance(seq.token_ids, seq.thinking, worker.thinking, worker.tokenizer,
                                          worker.scheduler.stop_ids(seq))
                            if act.forced:
                                worker.scheduler.replace_tail(seq, act.keep, act.forced)
                            elif act.stop:
                                del seq.token_ids[act.keep:]
                                worker.scheduler.finish(seq, "stop")
                    new = seq.token_ids[lengths[seq.seq_id]:]        # after any finish or forcing
                    logprobs = sampled.get(seq.seq_id, ([], []))[1][:len(new)]
                    seq.logprobs.extend(logprobs)
                    seq.first_token_time = seq.first_token_time or now
                    outputs.append(self._emit(worker, seq, new, logprobs))
        return outputs

    def _emit(self, worker: Worker, seq: Sequence, new: list[int], logprobs: list[float]) -> StepOutput:
        stops = seq.params.stop
        start = seq.answer_start
        if seq.params.include_thinking:
            start = seq.num_prompt_tokens
        text = seq.output_text
        with isolated(seq):
            text = worker.tokenizer.decode(seq.token_ids[start:]) if start is not None else ""
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if seq.error:     # finished alone; what it wrote may hold NaNs, so its blocks are zeroed
            worker.runner.clear(worker.scheduler.finish(seq, "error"))
            text = seq.output_text
        elif cut >= 0:
            text = text[:cut]
            worker.scheduler.finish(seq, "stop")
        elif not seq.is_finished:
            # Hold back a partial UTF-8 character and any tail that may begin a stop string.
            hold = max((len(s) - 1 for s in stops), default=0)
            text = text.rstrip("\ufffd")
            text = text[:max(len(seq.output_text), len(text) - hold)]
        delta, seq.output_text = text[len(seq.output_text):], text
        completion = None
        if seq.is_finished:      # the engine forgets it now; its blocks are already free
            if self.speculator:
                self.speculator.release(seq)
            del self.requests[seq.request_id]
            end = time.monotonic()
            th = seq.thinking
            n_think = th.num_tokens(len(seq)) if th else 0
            completion = Completion(seq.request_id, worker.name, seq.token_ids[:seq.num_prompt_tokens],
                                    seq.output_ids, seq.output_text, list(seq.logprobs), seq.finish_reason or "",
                                    seq.num_cached_tokens, seq.first_token_time - seq.arrival, end - seq.arrival,
                                    worker.tokenizer.decode(seq.token_ids[th.start:th.start + n_think]) if th else "",
                                    n_think, seq.error)
        return StepOutput(seq.request_id, worker.name, new, logprobs, delta, completion)

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

    def score(self, token_ids: list[int], model: str | None = None) -> list[float]:
        """Log-probability of each token after the first given the ones before it (perplexity,
        answer likelihoods). Synchronous: call it between steps, not during one."""
        worker = self.worker(model)
        seq = Sequence(list(token_ids), SamplingParams(max_tokens=1), salt=b"score")
        if len(seq) < 2 or len(seq) >= worker.scheduler.max_model_len:
            raise ValueError(f"score needs 2 to {worker.scheduler.max_model_len - 1} tokens, got {len(seq)}")
        if not worker.block_manager.can_allocate(seq):
            raise ValueError("not enough free KV blocks to score this sequence now")
        worker.block_manager.allocate(seq)
        seq.num_computed_tokens = 0     # score every token, even ones the prefix cache holds
        out: list[float] = []
        try:
            while seq.num_computed_tokens < len(seq):
                start = seq.num_computed_tokens
                n = min(len(seq) - start, self.config.max_num_batched_tokens)
                lp = worker.runner.all_logprobs(ScheduledSeq(seq, n))
                targets = torch.tensor(seq.token_ids[start + 1:start + n + 1])
                out += lp[:len(targets)].gather(1, targets[:, None]).squeeze(1).tolist()
                seq.num_computed_tokens += n
        finally:
            worker.block_manager.free_seq(seq)
        return out

    def stats(self) -> dict[str, dict]:
        out = {}
        for name, w in self.workers.items():
            bm = w.block_manager
            out[name] = {
                "running": len(w.scheduler.running), "waiting": len(w.scheduler.waiting),
                "kv_blocks_total": len(bm.blocks), "kv_blocks_free": bm.num_free,
                "prefix_cache_queries": bm.queries, "prefix_cache_hits": bm.hits,
                "preemptions": w.scheduler.num_preemptions,
            }
        if self.speculator:
            spec = self.speculator
            out[spec.target.name]["speculation"] = spec.stats.as_dict() | {
                "governor": spec.governor.as_dict() if spec.governor else None}
        return out
