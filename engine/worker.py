"""One served model with everything that is per model (weights, tokenizer, KV blocks,
scheduler, stop checker, runner), and how the engine builds them under one memory budget."""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, field
from functools import cached_property

import msgspec
import torch

import kernels
from engine import awq_gptq
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, ModelEntry, ThinkingConfig
from engine.model import CausalLM, load_model
from engine.model_runner import Device, ModelRunner
from engine.prompter import Prompter
from engine.quantize import (
    BUCKETS,
    QuantLinear,
    apply_gemv_buckets,
    apply_gguf,
    apply_quantization,
    dequant_rows_default,
    dot_rows_default,
)
from engine.scheduler import Scheduler
from engine.stop_checker import StopChecker
from engine.tokenizer import Tokenizer
from models import convert
from models.store import derived_path, resolve


@dataclass
class Worker:
    name: str
    cfg: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    thinking: ThinkingConfig
    stop: StopChecker
    dequant_rows: int = 0           # quantized matmuls over this many rows or more dequantize (0: never)
    dot_rows: int = 0               # quantized matmuls over this many rows or more run on integer dot products
    dense_buckets: tuple[int, ...] = ()     # captured decode batch sizes whose quantized matmuls run dense
    # per bf16 layer kind (qkv, o, ...), or a quantized model's precision (int8, fp8), the captured
    # decode batch sizes that run the Triton GEMV
    gemv_buckets: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @cached_property
    def prompter(self) -> Prompter:
        return Prompter(self.tokenizer, self.thinking, self.cfg.max_position)

    def memory(self, block_size: int, quant: str) -> str:
        """What this model holds of the memory budget: its weights and its KV blocks."""
        blocks, kv_dtype = len(self.block_manager.blocks), self.runner.kv_dtype
        kv = blocks * ModelRunner.kv_bytes_per_block(self.cfg, block_size, kv_dtype == torch.int8, kv_dtype.itemsize)
        return (f"weights {weight_bytes(self.model) / 2**30:.2f} GiB ({quant}), "
                f"{blocks} KV blocks of {block_size} tokens = "
                f"{kv / 2**30:.2f} GiB ({str(kv_dtype).removeprefix('torch.')})")


def weight_bytes(model: CausalLM, per_token: bool = False) -> int:
    """Bytes of the model's weights as loaded (quantized ones included). per_token: the bytes
    a decode step reads, which leaves out the embedding table (one row of it is read)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if per_token:
        # int4 on dot products reads its zeros as zero * scale (zero_scales); a dense copy of
        # quantized weights, or the GEMV's transposed one (batch buckets), is read instead of
        # them, at the buckets that use it.
        unread = [m.zeros for m in model.modules() if getattr(m, "zero_scales", None) is not None]
        unread += [t for m in model.modules() for name in ("dense_w", "gemv_w", "gemv_scales")
                   if (t := getattr(m, name, None)) is not None]
        # The embedding is read a row at a time, unless the head reads the same bytes (gguf, tied).
        head = {t.data_ptr() for t in [*model.lm_head.parameters(), *model.lm_head.buffers()]}
        unread += [t for t in [*model.embed_tokens.parameters(), *model.embed_tokens.buffers()]
                   if t.data_ptr() not in head]
        total -= sum(t.numel() * t.element_size() for t in [*model.rotary.buffers(), *unread])
    return total


def default_quant(device: str = "auto") -> str:
    """The weights `quant = "auto"` loads on `device` (EngineConfig.device), what the server
    and evals load when none are named. On the CPU, gguf (each GGUF file's own blocks,
    docs/engine.md's GGUF section): float32's exact match within a point and perplexity within
    0.5%, the fewest bytes, faster than int8 at batch 1 and on prompts and as fast at batch 8 on
    Zen 3 cores, and on Zen 1's 128-bit AVX2 units 1.03x / 1.28x int8 at batch 1 (0.5B / 1.5B,
    benchmarks/results/cpu_decode_bench-gguf-zen1.json). On
    CUDA, int8: the GGUF Triton kernel measured 0.3-0.8x bf16 a layer on an H200, where int8
    measured 0.93-1.35x bf16 a step."""
    return "int8" if Device.named(device).type == "cuda" else "gguf"


def resolve_quant(config: EngineConfig) -> EngineConfig:
    """The config with each model's "auto" weights replaced by the device's default."""
    models = {name: msgspec.structs.replace(entry, quant=default_quant(config.device)) if entry.quant == "auto"
              else entry for name, entry in config.models.items()}
    return msgspec.structs.replace(config, models=models)


def load_workers(config: EngineConfig, progress: bool = True) -> dict[str, Worker]:
    """Every model of the config, through the model store, onto the configured device; what the
    weights leave of the memory budget becomes KV blocks, split between the models by kv_share."""
    device = Device.resolve(config)
    # This engine's choice alone: its runners hold the compiled kernels and set them around their calls.
    cpu_ops = kernels.cpu_ops(config.cpu_kernels and device.device.type == "cpu" and device.dtype == torch.float32)
    budget = device.memory_budget(config)       # before the weights: on CUDA, free memory now
    loaded = {name: _load(entry, progress, device) for name, entry in config.models.items()}
    _return_freed_memory()
    weights = sum(weight_bytes(model) for _, model, _ in loaded.values())
    free = budget - weights
    if free <= 0:
        raise ValueError(f"the memory budget ({budget / 2**30:.2f} GiB on {device.device}) does not even hold the "
                         f"weights ({weights / 2**30:.2f} GiB); raise memory_budget_gb (CPU) or "
                         f"gpu_memory_utilization (CUDA)")
    shares = sum(entry.kv_share for entry in config.models.values())
    kv_int8 = config.kv_cache_dtype == "int8"
    workers = {}
    for name, (cfg, model, tok) in loaded.items():
        per_block = ModelRunner.kv_bytes_per_block(cfg, config.block_size, kv_int8, device.dtype.itemsize)
        blocks = int(free * config.models[name].kv_share / shares // per_block)
        blocks = min(blocks, config.max_kv_blocks or blocks)
        if blocks < 2:
            raise ValueError(f"memory budget leaves {blocks} KV blocks for model {name!r}; raise memory_budget_gb")
        thinking = config.models[name].thinking
        bm = BlockManager(blocks, config.block_size, config.prefix_caching)
        # A sequence never outgrows the model's context nor the whole KV pool, so a lone
        # sequence can always make progress.
        stop = StopChecker(cfg, tok, thinking, min(cfg.max_position, blocks * config.block_size))
        # Before the graphs are captured: each bucket's graph holds its layers' choice.
        gemv = (apply_gemv_buckets(model, torch.cuda.get_device_name(device.device), BUCKETS)
                if device.device.type == "cuda" and config.models[name].dense_buckets else {})
        scheduler = Scheduler(bm, stop, config.max_num_batched_tokens, config.max_num_seqs, config.max_wait_steps)
        runner = ModelRunner(model, cfg, blocks, config.block_size, kv_int8, stop.bans, device, cpu_ops)
        runner.capture_graphs(config.max_num_seqs, scheduler.max_model_len)
        quant = next((m for m in model.modules() if isinstance(m, QuantLinear)), None)
        ways = quant.ways if quant else ()
        if "gemv" in ways:      # a quantized model's layers on the GEMV, under its precision's name
            gemv[quant.mode] = tuple(way == "gemv" for way in ways)
        workers[name] = Worker(name, cfg, model, tok, bm, scheduler, runner, thinking, stop,
                               quant.dequant_rows if quant else 0, quant.dot_rows if quant else 0,
                               tuple(b for b in runner.graphs.buckets if b < len(ways) and ways[b] == "dense")
                               if runner.graphs else (),
                               {kind: tuple(b for b in runner.graphs.buckets if b < len(rows) and rows[b])
                                for kind, rows in gemv.items()} if runner.graphs else {})
    return workers


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system. Loading reads, merges and repacks each
    weight, and glibc keeps what the process frees for allocations that never come: the 1.5B
    loaded as gguf left 585 MB resident beyond its weights, 17 once returned
    (benchmarks/demo_memory.py)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):     # not glibc: nothing to trim this way
        pass


def _load(entry: ModelEntry, progress: bool, device: Device) -> tuple[ModelConfig, CausalLM, Tokenizer]:
    folder = resolve(entry.source, progress=progress)
    cfg = ModelConfig.from_folder(folder)
    if entry.quant == "gguf":
        blocks = folder / convert.BLOCKS
        if not blocks.is_file():
            raise ValueError(f"model {entry.source!r}: quant \"gguf\" computes on a GGUF file's own blocks, and "
                             f"{folder} was not converted from one; choose int8 or int4 for a float checkpoint")
        model = load_model(folder, cfg, linear_weights=False, device=device.device, dtype=device.dtype,
                           embedding=False)
        return cfg, apply_gguf(model, folder, blocks, entry.gguf_steps, entry.gguf_steps_on), Tokenizer(folder)
    stored = awq_gptq.scheme(folder, entry.quant)
    if stored is not None:
        model = awq_gptq.load(folder, cfg, stored, device.device, device.dtype, entry.dequant_rows, entry.dot_rows)
        return cfg, model, Tokenizer(folder)
    cache = derived_path(folder, f"{entry.quant}-g{entry.group_size}.safetensors")
    if entry.quant != "none" and not cache.exists():
        # Quantized once, from float32 weights on the host: one stored format, whatever device
        # and dtype the engine runs in.
        apply_quantization(load_model(folder, cfg), entry.quant, entry.group_size, cache)
    # A quantized model never reads its float linear weights.
    model = load_model(folder, cfg, linear_weights=entry.quant == "none", device=device.device, dtype=device.dtype)
    if entry.quant != "none":
        dot = dot_rows_default() if entry.dot_rows is None else entry.dot_rows
        rows = (dequant_rows_default(device.device.type, entry.quant, entry.group_size, dot)
                if entry.dequant_rows is None else entry.dequant_rows)
        model = apply_quantization(model, entry.quant, entry.group_size, cache, rows, dot,
                                   BUCKETS if entry.dense_buckets else None)
    return cfg, model, Tokenizer(folder)
