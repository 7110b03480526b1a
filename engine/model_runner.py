"""Runs one model over a scheduled step: flatten the sequences into one batch (token ids,
positions, slot mapping, block tables, context lengths), one forward pass, then sample.

Every device difference of the engine lives here (and in the kernels' dispatcher): `Device`
resolves where the engine runs and its memory budget, `PinnedRing` takes a step's host-built
index tensors there; the runner keeps the KV cache on it, picks every row's token there
(`sampler.select`) with one read back per step, and on CUDA replays decode steps from graphs:
the layers', then the LM head's with the greedy or sampled picks. On the CPU the same code
runs with every copy a no-op."""
from __future__ import annotations

import itertools
import logging
import math
import sys
import weakref
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

import kernels
from engine.config import EngineConfig, ModelConfig
from engine.cpu_step import CPUStep
from engine.model import CausalLM, StepBatch
from engine.sampler import SamplingRows, fill_noise, select, verify
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, failure
from engine.step import RunnerOutput, ScheduledSeq, SchedulerOutput

log = logging.getLogger("sluice.engine")
_GREEDY = SamplingParams()          # a graph's padding rows


@dataclass(frozen=True)
class Device:
    """Where the engine runs and in what dtype."""
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    cuda_graphs: bool = False
    cpu_step: bool = False

    @staticmethod
    def named(device: str) -> torch.device:
        """EngineConfig.device as a torch device: "auto" is CUDA when torch sees a GPU, else the CPU."""
        return torch.device(device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")

    @classmethod
    def resolve(cls, config: EngineConfig) -> Device:
        """The configured device (`named`); the compute dtype "auto" is bfloat16 on CUDA and
        float32 on the CPU."""
        device = cls.named(config.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"engine config: device {config.device!r} but torch sees no CUDA device "
                                 f"(torch {torch.__version__})")
            # An explicit index: generators and tensors report one, and compare equal to it.
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            torch.cuda.set_device(device)       # Triton launches and graph capture use the current device
        dtype = getattr(torch, config.dtype) if config.dtype != "auto" else (
            torch.bfloat16 if device.type == "cuda" else torch.float32)
        kv = config.kv_cache_dtype
        if kv not in ("auto", "int8") and getattr(torch, kv) != dtype:
            raise ValueError(f"engine config: kv_cache_dtype {kv!r} differs from the compute dtype "
                             f"({str(dtype).removeprefix('torch.')}); use auto or int8")
        cpu = device.type == "cpu"
        return cls(device, dtype, config.cuda_graphs and not cpu, config.cpu_step and cpu)

    def memory_budget(self, config: EngineConfig) -> int:
        """Bytes for every model's weights plus KV. On CUDA: gpu_memory_utilization of the
        device's free memory, read before any weights load (the rest is left for activations
        and graphs); on the CPU: memory_budget_gb."""
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0] * config.gpu_memory_utilization)
        return int(config.memory_budget_gb * 2**30)

    def bind(self) -> None:
        """Make this the current device of the calling thread (Triton launches and CUDA
        graphs use the current device, which is per thread)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's seeded generator, on this device (same seed, same output per device)."""
        gen = seq.generator
        if gen is not None and gen.device != self.device:
            gen = seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return gen


def _padded(rows: list[list[int]]) -> list[int]:
    """Block tables padded with each row's own first block (attention reads, and masks,
    padding too, and a block of another sequence may hold its NaNs: 0 * NaN is NaN),
    flattened."""
    width, flat = max(map(len, rows)), []
    for r in rows:
        flat += r if len(r) == width else r + r[:1] * (width - len(r))
    return flat


def _pack(ints: list[list[int]], floats: list[list[float]] = ()) -> tuple[array, list[int]]:
    """Lists of ints, then lists of floats (as float64 bits), in one int64 buffer, and each
    one's length: filling an array from them costs a fraction of torch.tensor over them."""
    flat = array("q")
    for f in ints:
        flat.fromlist(f)
    for f in floats:
        flat.frombytes(array("d", f).tobytes())
    return flat, [len(f) for f in (*ints, *floats)]


class PinnedRing:
    """A step's packed index tensors on their way to the device: written into one of a ring
    of persistent pinned host buffers, then one non-blocking copy. A CUDA event per buffer
    marks when its last copy has read it: async scheduling builds step N + 1's inputs while
    step N runs, and step N + 2's reuse step N's buffer only after its copy (by then done: the
    engine has waited for step N's tokens). A buffer grows, doubling, when a step needs more.
    (On the CPU the runner uses none: its index tensors view the packed buffer itself.)"""

    def __init__(self, device: torch.device, slots: int = 2):
        self.device, self.cuda = device, device.type == "cuda"
        self.buffers = [torch.empty(0, dtype=torch.int64) for _ in range(slots)]
        self.events = [torch.cuda.Event() for _ in range(slots)] if self.cuda else []
        self.next = 0

    def upload(self, flat: array, sizes: list[int]) -> list[torch.Tensor]:
        i, n = self.next, len(flat)
        self.next = (i + 1) % len(self.buffers)
        if self.cuda:
            self.events[i].synchronize()
        if self.buffers[i].numel() < n:
            self.buffers[i] = torch.empty(max(n, 2 * self.buffers[i].numel()), dtype=torch.int64,
                                          pin_memory=self.cuda)
        host = self.buffers[i][:n]
        host.copy_(torch.frombuffer(flat, dtype=torch.int64))
        out = torch.empty(n, dtype=torch.int64, device=self.device).copy_(host, non_blocking=True)
        if self.cuda:
            self.events[i].record()
        return list(out.split_with_sizes(sizes))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) (the first largest value; a NaN counts as largest), several times
    faster over many logits on the CPU, where argmax does not vectorize and a max does: the
    largest of each block of 64, then the first of those, then the winning block is searched.
    Below 2**15 logits one argmax costs less than the calls that takes."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % 64 or logits.numel() < 2**15:
        return logits.argmax(-1)
    blocks = logits.reshape(rows, vocab // 64, 64)
    best = blocks.amax(-1).argmax(-1)
    return best * 64 + blocks[torch.arange(rows), best].argmax(-1)


def _greedy(logits: torch.Tensor, logprobs_out: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token and its log-probability, as one [rows, 2] float tensor (float32
    holds token ids exactly, below 2**24), so that one read brings both back. The log-softmax
    (into `logprobs_out`) is the one pass that computes over the logits (the argmax only reads
    them), and their check: a row holding a NaN or +inf comes out NaN, which fails its request
    (a -inf is a token ruled out, as a sub-vocabulary's are)."""
    logprobs = torch.log_softmax(logits, -1, out=logprobs_out)
    top = _argmax(logits)[:, None]
    return torch.cat([top, logprobs.gather(1, top)], 1)


@dataclass
class _Sampled:
    """The rows of a step that `select` runs on, prepared with its inputs: their sampling
    parameters on the device, where they sit among the head's rows (None: the first ones, a
    graph's bucket of decode rows, the padding greedy), each sampling item's row among them,
    and whether any uses top-k or top-p."""
    rows: SamplingRows
    index: torch.Tensor | None
    at: dict[int, int]
    filtered: bool


@dataclass
class _Graphs:
    """Decode steps captured per padded batch size, and the static tensors they read and write:
    the layers' graph (to `hidden`), and the head's (the LM head to `logits`, each row's token
    and log-probability to `top`), in three forms: greedy picks, or `select` over the rows'
    sampling parameters and noise (`rows`, `noise`), with or without top-k / top-p (which
    sort). A drafter's steps replay the layers alone: it reads its hidden states through a
    sub-vocabulary head of its own."""
    buckets: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    logprobs: torch.Tensor
    top: torch.Tensor
    rows: SamplingRows
    noise: torch.Tensor
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)     # batch size -> layers' graph
    heads: dict[tuple[int, str], torch.cuda.CUDAGraph] = field(default_factory=dict)  # (batch size, HEADS) -> head's

    def replay(self, bucket: int, head: str | None = "greedy") -> None:
        self.graphs[bucket].replay()
        if head is not None:
            self.heads[bucket, head].replay()

    def head(self, bucket: int, sampled: _Sampled | None) -> str:
        """The head a step replays: a sampled one when rows sample and it was captured."""
        mode = "greedy" if sampled is None else "filtered" if sampled.filtered else "sampled"
        return mode if (bucket, mode) in self.heads else "greedy"


HEADS = ("greedy", "sampled", "filtered")


def _capture(step: Callable[[], None], pool):
    """`step` recorded as a CUDA graph (replay() runs it again on the same tensors), and the
    memory pool the graphs share."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool):
        step()
    torch.cuda.synchronize()
    return graph, pool or graph.pool()


@dataclass
class SubVocab:
    """An LM head over some token ids only: a drafter's cheaper head, since the head is a
    small model's largest matrix (a fifth of Qwen2.5-0.5B's decode step). Every other token's
    logit is -inf, so sampling, bans and the rejection rule see an ordinary distribution."""
    ids: torch.Tensor
    head: torch.nn.Module
    vocab_size: int

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.head(hidden)
        return sub.new_full((len(hidden), self.vocab_size), float("-inf")).index_copy_(1, self.ids, sub)


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, num_blocks: int, block_size: int, kv_int8: bool = False,
                 bans: Callable[[ScheduledSeq, int], list[int]] | None = None, device: Device = Device(),
                 cpu_ops: dict[str, Callable] | None = None):
        """bans(item, i): token ids the model may not write at index i of a scheduled sequence
        (StopChecker.bans). cpu_ops: the compiled CPU kernels this model runs (kernels.cpu_ops),
        None: their references."""
        self.model, self.cfg, self.block_size, self.bans, self.device = model, cfg, block_size, bans, device
        self.cpu_ops = cpu_ops
        # With graphs, one more block than the block manager hands out: padded rows of a
        # captured batch write and read it, so they never touch a sequence's KV.
        self.scratch = num_blocks if device.cuda_graphs else None
        shape = (num_blocks + (self.scratch is not None), block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype, dev = torch.int8 if kv_int8 else device.dtype, device.device
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev),
                           *((torch.ones(shape[:-1], device=dev), torch.ones(shape[:-1], device=dev))
                             if kv_int8 else (None, None)))
                          for _ in range(cfg.num_layers)]
        self.graphs: _Graphs | None = None
        self.cpu_step = CPUStep.build(model, self.kv_caches, cpu_ops is not None) if device.cpu_step else None
        # Buffers kept across steps: on the CPU a fresh one past 32 MiB is mapped, and page-faulted
        # in, at every step. _greedy's output, and the noise of the rows that sample.
        self.log_softmax_out = torch.empty(0, cfg.vocab_size, device=dev)
        self.noise = torch.empty(0, cfg.vocab_size, device=dev)
        self.inputs = PinnedRing(dev) if dev.type == "cuda" else None
        self.queue: ThreadPoolExecutor | None = None        # async scheduling's (start_queue)
        self.last: dict[int, int] = {}      # seq_id -> the token the latest step sampled, for placeholders

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_caches[0][0].dtype

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_int8: bool = False, float_bytes: int = 4) -> int:
        per_head = cfg.head_dim + 4 if kv_int8 else cfg.head_dim * float_bytes   # int8 values + one fp32 scale
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * per_head

    def start_queue(self) -> None:
        """Async scheduling: from now on steps run on a queue of their own, one after another
        as a device stream runs kernels, while the host plans and prepares the next."""
        self.queue = ThreadPoolExecutor(1, thread_name_prefix="sluice-device", initializer=self.device.bind)
        weakref.finalize(self, self.queue.shutdown, wait=False)
        # A thread waiting for the GIL gets it after the switch interval (5 ms by default, more
        # than a step): the queue's step, its forward done, would wait out the host's planning.
        # At most 0.2 ms: measured with benchmarks/step_overhead.py (docs/engine.md).
        sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))

    def clear(self, block_ids: list[int]) -> None:
        """Zero blocks whose KV may be non-finite: attention reads a block's stale slots too,
        masked, and 0 * NaN is NaN. After the steps already queued, which may still write them."""
        if self.queue is not None:
            self.queue.submit(self._clear, block_ids)
        else:
            self._clear(block_ids)

    def _clear(self, block_ids: list[int]) -> None:
        for t in (t for layer in self.kv_caches for t in layer if t is not None):
            t[block_ids] = 0

    def prepare(self, scheduled: list[ScheduledSeq], pad_to: int = 0) -> tuple[
            torch.Tensor, torch.Tensor, StepBatch, tuple[torch.Tensor, list[int], list[tuple[int, int]]]]:
        """Flatten the step: single-token decodes first (one batched attention call), then
        chunks (prefills and speculative verifications). Also returns the rows the LM head
        runs on (each sampling item's last row, or a verification's k + 1), the indices of
        those items in `scheduled`, and (row, seq_id) of each placeholder, whose token the step
        before samples. Reads the items, and of their sequences the block tables and the tokens
        before their starts.
        pad_to: a decode-only step padded to a captured batch size with rows on the scratch block."""
        decodes, chunks = [], []
        for i, item in enumerate(scheduled):
            (decodes if item.is_decode else chunks).append(i)
        bs, pad = self.block_size, max(pad_to - len(decodes), 0)
        ids, positions, slots = [], [], []
        # A window's dropped tokens hold no slot: a token's slot and a sequence's context length
        # count what its cache holds, while its rotary position stays its own (shift).
        placeholders = []
        for i in decodes:            # the newest token of each, which samples
            seq, pos = scheduled[i].seq, scheduled[i].start
            if scheduled[i].placeholder:
                placeholders.append((len(ids), seq.seq_id))
            ids.append(0 if scheduled[i].placeholder else seq.token_ids[pos])
            positions.append(pos)
            c = pos - seq.num_dropped
            slots.append(seq.block_table[c // bs] * bs + c % bs)
        head_rows, sampling = list(range(len(decodes))), list(decodes)
        for i in chunks:
            item = scheduled[i]
            seq, start, end = item.seq, item.start, item.start + item.num_tokens
            if item.samples:
                head_rows += range(len(ids) + item.num_tokens - 1 - item.num_draft, len(ids) + item.num_tokens)
                sampling.append(i)
            ids += item.tokens(start, end)
            positions += range(start, end)
            slots += [seq.block_table[c // bs] * bs + c % bs for c in range(start - seq.num_dropped,
                                                                             end - seq.num_dropped)]
        tables = [scheduled[i].seq.block_table for i in decodes]
        lens = [scheduled[i].start + 1 - scheduled[i].seq.num_dropped for i in decodes]
        if pad:
            ids += [0] * pad
            positions += [0] * pad
            slots += [self.scratch * bs] * pad
            tables += [[self.scratch]] * pad
            lens += [1] * pad
        fields = [ids, positions, slots, head_rows]
        if decodes:
            fields += [_padded(tables), lens]
        if chunks:
            items = [scheduled[i] for i in chunks]
            fields += [_padded([s.seq.block_table for s in items]),
                       [s.start - s.seq.num_dropped + s.num_tokens for s in items],
                       list(itertools.accumulate((s.num_tokens for s in items), initial=0))]
        # The items that sample (a verification's rows run `verify` instead) and their rows
        # among the head's; `select` runs on those rows, or with a graph on every decode row.
        at, rows = 0, {}
        for i in sampling:
            if not scheduled[i].num_draft and not scheduled[i].seq.params.greedy:
                rows[i] = at
            at += 1 + scheduled[i].num_draft
        floats = []
        if rows:
            params = ([scheduled[i].seq.params for i in decodes] + [_GREEDY] * pad if pad_to else
                      [scheduled[i].seq.params for i in rows])
            temperature, top_k, top_p = SamplingRows.host(params, self.cfg.vocab_size)
            fields += [top_k] if pad_to else [top_k, list(rows.values())]
            floats = [temperature, top_p]
        flat, sizes = _pack(fields, floats)
        parts = (self.inputs.upload(flat, sizes) if self.inputs is not None else
                 list(torch.frombuffer(flat, dtype=torch.int64).split_with_sizes(sizes)))
        sampled = None
        if rows:
            extra = 3 if pad_to else 4          # top_k, (index), temperature, top_p
            top_k, *index, temperature, top_p = parts[-extra:]
            del parts[-extra:]
            sampled = _Sampled(SamplingRows(temperature.view(torch.float64).float(), top_k,
                                            top_p.view(torch.float64).float()), index[0] if index else None,
                               {i: rows[i] if pad_to else k for k, i in enumerate(rows)},
                               SamplingRows.filters([scheduled[i].seq.params for i in rows], self.cfg.vocab_size))
        input_ids, positions, slot_mapping, head_rows, *rest = parts
        batch = StepBatch(slot_mapping, len(decodes) + pad, self.kv_caches)
        if decodes:
            tables, batch.decode_context_lens, *rest = rest
            batch.decode_block_tables = tables.view(len(lens), -1)
        if chunks:
            tables, batch.prefill_context_lens, batch.prefill_query_start = rest
            batch.prefill_block_tables = tables.view(len(chunks), -1)
        return input_ids, positions, batch, (head_rows, sampling, placeholders, sampled)

    @staticmethod
    def sinks(scheduled: list[ScheduledSeq]) -> list[tuple[list[int], list[int], int]]:
        """What `shift` rewrites this step, read when the step is prepared: (original sink
        blocks, their copies, tokens dropped) of each sequence whose window dropped tokens."""
        return [(item.seq.sink_source, item.seq.block_table[:len(item.seq.sink_source)], item.seq.num_dropped)
                for item in scheduled if item.shift and item.seq.sink_source]

    @torch.inference_mode()
    def shift(self, sinks: list[tuple[list[int], list[int], int]]) -> None:
        """Rewrite the sinks of sequences whose window dropped tokens before this step. Their
        new tokens and kept keys stay at their own rotary positions, so the distance from a
        query to a kept key is what StreamingLLM's positions within the cache give; a sink's
        is that less the tokens dropped, so its key is its original one rotated forward by
        them (RoPE composes). Rotated from the untouched original each time, an int8 or bf16
        sink is rounded once, never again and again as rotating every kept key back at each
        drop would do (docs/engine.md measures that drift); and one block is rotated per
        drop rather than the whole window."""
        dev = self.device.device
        for source, copies, d in sinks:
            src, dst = torch.tensor(source, device=dev), torch.tensor(copies, device=dev)
            for k, v, k_scale, v_scale in self.kv_caches:
                kernels.rotate_keys(k, src, dst, self.model.rotary.cos[d], self.model.rotary.sin[d], k_scale)
                for t in (v, v_scale):
                    if t is not None:
                        t.index_copy_(0, dst, t.index_select(0, src))

    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """CUDA graphs of the decode step for batch sizes 1, 2, 4, 8, 16, 32, ... up to
        max_num_seqs, largest first, sharing one memory pool (nano-vllm's recipe). A kernel
        that cannot be captured (decode attention fell back to its reference, which reads
        lengths on the host) leaves this model eager, logged."""
        if not self.device.cuda_graphs:
            return
        dev, bs = self.device.device, self.block_size
        buckets = sorted({b for b in (1, 2, 4, 8, *range(16, max_num_seqs, 16)) if b < max_num_seqs} | {max_num_seqs})
        n, width, vocab = buckets[-1], -(-max_model_len // bs), self.cfg.vocab_size
        g = _Graphs(buckets, torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev),
                    torch.full((n,), self.scratch * bs, device=dev), torch.ones(n, dtype=torch.long, device=dev),
                    torch.full((n, width), self.scratch, device=dev),
                    torch.zeros(n, self.cfg.hidden_size, dtype=self.device.dtype, device=dev),
                    torch.zeros(n, vocab, device=dev), torch.zeros(n, vocab, device=dev), torch.zeros(n, 2, device=dev),
                    SamplingRows(torch.zeros(n, device=dev), torch.full((n,), vocab, device=dev),
                                 torch.full((n,), math.inf, device=dev)),
                    torch.full((n, vocab), 0.5, device=dev))

        def head(b: int, mode: str) -> None:
            g.logits[:b] = self.model.logits(g.hidden[:b])
            top = _greedy(g.logits[:b], g.logprobs[:b])
            if mode != "greedy":
                top = select(g.logits[:b], g.logprobs[:b], top, g.rows[:b], g.noise[:b], mode == "filtered")[0]
            g.top[:b] = top
        pool = None
        try:
            for b in reversed(buckets):
                batch = StepBatch(g.slot_mapping[:b], b, self.kv_caches, decode_block_tables=g.block_tables[:b],
                                  decode_context_lens=g.context_lens[:b])

                def step(b: int = b, batch: StepBatch = batch) -> None:
                    g.hidden[:b] = self.model(g.input_ids[:b], g.positions[:b], batch)
                step()                  # warm up: compile and launch every kernel before capture
                head(b, "greedy")
                if "paged_decode_attention" in kernels.FALLBACKS:
                    raise RuntimeError("decode attention runs its reference twin, which cannot be captured")
                g.graphs[b], pool = _capture(step, pool)
                g.heads[b, "greedy"], pool = _capture(lambda b=b: head(b, "greedy"), pool)
        except Exception as e:
            log.warning("CUDA graphs off for a %s model (%s); its decode steps run eagerly", self.cfg.arch, e)
            return
        try:
            for b in reversed(buckets):
                for mode in HEADS[1:]:
                    head(b, mode)
                    g.heads[b, mode], pool = _capture(lambda b=b, mode=mode: head(b, mode), pool)
        except Exception as e:      # the greedy heads still run; sampled rows select after them
            log.warning("sampled heads not captured for a %s model (%s); its sampled rows select eagerly",
                        self.cfg.arch, e)
            g.heads = {key: graph for key, graph in g.heads.items() if key[1] == "greedy"}
        self.graphs = g

    def _bucket(self, scheduled: list[ScheduledSeq]) -> int:
        """The captured batch size a decode-only step pads to; 0: run it eagerly."""
        g = self.graphs
        if (g is None or len(scheduled) > g.buckets[-1] or not all(s.is_decode for s in scheduled)
                or max(len(s.seq.block_table) for s in scheduled) > g.block_tables.shape[1]):
            return 0
        return next(b for b in g.buckets if b >= len(scheduled))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch, bucket: int,
                 head: str | None, sampled: _Sampled | None, noise: list) -> torch.Tensor:
        """The step's hidden states; replayed from a bucket's graphs, with `head` one of the
        head's too (its logits and picks in the graphs' static tensors; a sampled head reads
        the rows' parameters and fresh noise, `noise` as fill_noise takes it)."""
        if not bucket:
            if self.cpu_step is not None and self.cpu_step.takes(batch, len(input_ids)):
                return self.cpu_step(input_ids, positions, batch)
            with kernels.with_cpu_ops(self.cpu_ops):
                return self.model(input_ids, positions, batch)
        g = self.graphs
        g.input_ids[:bucket] = input_ids
        g.positions[:bucket] = positions
        g.slot_mapping[:bucket] = batch.slot_mapping
        g.context_lens[:bucket] = batch.decode_context_lens
        # Columns past this step's widest table keep stale blocks: the kernel reads no entry
        # past a row's context length.
        g.block_tables[:bucket, :batch.decode_block_tables.shape[1]] = batch.decode_block_tables
        if head in HEADS[1:]:
            for static, rows in zip((g.rows.temperature, g.rows.top_k, g.rows.top_p),
                                    (sampled.rows.temperature, sampled.rows.top_k, sampled.rows.top_p)):
                static[:bucket] = rows
            fill_noise(g.noise[:bucket], noise)
        g.replay(bucket, head)
        return g.hidden[:bucket]

    def sub_vocab(self, first: int, keep: frozenset[int] | set[int]) -> SubVocab | None:
        """A head over the first `first` token ids (byte-pair ranks: the most frequent merges
        come first) and those in `keep`, in whole aligned blocks of 32 ids or of what the head's
        layout needs (torch's packed int4: 64 under AVX-512); None when that is the whole
        vocabulary."""
        size, b = self.model.cfg.vocab_size, max(32, self.model.lm_head.row_block)
        starts = sorted(set(range(0, min(first, size), b)) | {i // b * b for i in keep if 0 <= i < size})
        ids = torch.cat([torch.arange(s, min(s + b, size)) for s in starts]).to(self.device.device)
        if len(ids) >= size:
            return None
        return SubVocab(ids, self.model.lm_head.rows(ids), size)

    def logprobs(self, item: ScheduledSeq, skip: int = 0) -> torch.Tensor:
        """Log-probability of the token after each position of one chunk (scoring), from its
        row `skip` on, on the host: the LM head and softmax only for the rows asked for. After
        the steps already queued."""
        if self.queue is not None:
            return self.queue.submit(self._logprobs, item, skip).result()
        return self._logprobs(item, skip)

    @torch.inference_mode()
    def _logprobs(self, item: ScheduledSeq, skip: int) -> torch.Tensor:
        self.shift(self.sinks([item]))
        input_ids, positions, batch, _ = self.prepare([item])
        with kernels.with_cpu_ops(self.cpu_ops):
            hidden = self.model(input_ids, positions, batch)[skip:]
        start = item.start + skip
        targets = torch.tensor(item.tokens(start + 1, start + 1 + len(hidden)), device=hidden.device)
        lp = torch.log_softmax(self.model.logits(hidden).float(), dim=-1)
        return lp.gather(1, targets[:, None]).squeeze(1).cpu()

    def run(self, sched: SchedulerOutput, return_probs: bool = False, vocab: SubVocab | None = None) -> RunnerOutput:
        """One step: for each item that reaches its sequence's end, its new tokens (one, or for
        a verification the accepted drafts plus one) and their log-probabilities under the
        model's own distribution; with return_probs, the distribution a sampled token came from
        (for the rejection rule); with `vocab`, tokens come from it only. An item whose share
        fails (non-finite logits, a sampling error) gets its error and no tokens."""
        return self._execute(*self._host(sched.items), return_probs, vocab)

    def launch(self, sched: SchedulerOutput) -> Future[RunnerOutput]:
        """Async scheduling: the step's inputs are built on the host now; its forward and
        sampling run on the queue after the steps before it (run's output, when done)."""
        return self.queue.submit(self._execute, *self._host(sched.items))

    def _host(self, items: list[ScheduledSeq]) -> tuple:
        bucket = self._bucket(items)
        return items, bucket, self.sinks(items), self.prepare(items, bucket)

    @torch.inference_mode()
    def _execute(self, items: list[ScheduledSeq], bucket: int, sinks: list, prepared: tuple,
                 return_probs: bool = False, vocab: SubVocab | None = None) -> RunnerOutput:
        self.shift(sinks)
        input_ids, positions, batch, (head_rows, sampling, placeholders, sampled) = prepared
        if placeholders:
            rows, seq_ids = zip(*placeholders)
            input_ids[list(rows)] = torch.tensor([self.last.get(i, 0) for i in seq_ids], device=input_ids.device)
        in_graph = bool(bucket) and vocab is None
        # return_probs wants the distributions, which a graph keeps to itself: such a step
        # replays the greedy head and selects after it.
        head = self.graphs.head(bucket, None if return_probs else sampled) if in_graph else None
        # (row among the sampled ones, its generator): a seeded request's own, on this device.
        noise = [(k, self.device.generator(items[i].seq)) for i, k in sampled.at.items()] if sampled else []
        hidden = self._forward(input_ids, positions, batch, bucket, head, sampled, noise)
        out = RunnerOutput.empty(len(items))
        if in_graph:            # a decode-only step: each item samples from its own row
            g = self.graphs
            logits, logprobs, top = g.logits[:len(items)], g.logprobs[:len(items)], g.top[:len(items)]
        elif sampling:
            # One LM-head pass over every sampling row, as the head is the largest matrix.
            rows = hidden.index_select(0, head_rows)
            logits = (self.model.logits(rows) if vocab is None else vocab.logits(rows)).float()
            if self.log_softmax_out.shape[0] < len(rows):
                self.log_softmax_out = torch.empty_like(logits)
            logprobs = self.log_softmax_out[:len(rows)]
            top = _greedy(logits, logprobs)
        if sampling:
            self._sample(items, sampling, logits, logprobs, top, sampled, noise, head in HEADS[1:], out, return_probs)
        if self.queue is not None:
            self.last = {items[i].seq.seq_id: out.token_ids[i][-1] for i in sampling if out.token_ids[i]}
        return out

    def _sample(self, items: list[ScheduledSeq], sampling: list[int], logits: torch.Tensor, logprobs: torch.Tensor,
                top: torch.Tensor, sampled: _Sampled | None, noise: list, selected: bool, out: RunnerOutput,
                return_probs: bool) -> None:
        """The sampling items' tokens into `out` (see run), from the head's rows: their logits,
        log-softmax and picks `top` (greedy, or with `selected` a sampled graph's). The rows
        that sample run `select` here unless a graph did. A thinking item's row whose bans are
        not empty picks again from its logits with those tokens at -inf (row by row: the bans
        are known only now; with the row's own noise, so graph or not, the same draw). A
        verification's rows run `verify` (eager: each acceptance decides whether the next row
        is read), bans applied. The picks are read back once: the step's one sync."""
        dists, g = {}, self.graphs
        if sampled is not None:
            m = len(items) if sampled.index is None else len(sampled.at)
            if selected:
                noise_rows = g.noise
            else:           # the very function the sampled graphs hold, on the rows that sample
                if self.noise.shape[0] < m:
                    self.noise = logits.new_empty(m, logits.shape[1])
                noise_rows = self.noise[:m]
                fill_noise(noise_rows, noise)
                index = sampled.index

                def rows(t: torch.Tensor) -> torch.Tensor:
                    return t[:m] if index is None else t.index_select(0, index)
                try:
                    chosen, dist = select(rows(logits), rows(logprobs), rows(top), sampled.rows[:m], noise_rows,
                                          sampled.filtered)
                except Exception as exc:
                    for i in sampled.at:
                        out.errors[i] = failure(items[i].seq, exc)
                    sampled = None
                else:
                    if index is None:
                        top[:m] = chosen
                    else:
                        top.index_copy_(0, index, chosen)
                    dists = {i: dist[k:k + 1] for i, k in sampled.at.items()} if return_probs else {}
        spans, at = [], 0
        for i in sampling:
            item = items[i]
            first, at = at, at + 1 + item.num_draft
            spans.append((i, first, at))
            if self.bans is None or item.seq.thinking is None or out.errors[i]:
                continue
            try:
                end = item.start + item.num_tokens - item.num_draft      # the sequence's length
                for j in range(at - first):                             # row first + j predicts index end + j
                    if not (banned := self.bans(item, end + j)):
                        continue
                    r = first + j
                    logits[r, banned] = float("-inf")
                    if item.num_draft:
                        continue
                    top[r:r + 1] = _greedy(logits[r:r + 1], logprobs[r:r + 1])
                    if sampled is not None and (k := sampled.at.get(i)) is not None:
                        top[r:r + 1], dist = select(logits[r:r + 1], logprobs[r:r + 1], top[r:r + 1],
                                                    sampled.rows[k:k + 1], noise_rows[k:k + 1], sampled.filtered)
                        dists[i] = dist
            except Exception as exc:
                out.errors[i] = failure(item.seq, exc)
        tokens, lps = top.T.tolist()
        for i, first, at in spans:
            item, seq = items[i], items[i].seq
            if out.errors[i]:
                continue
            if not all(map(math.isfinite, lps[first:at])):
                out.errors[i] = failure(seq, FloatingPointError("the model's logits for this request are not finite"))
                continue
            if not item.num_draft:
                out.token_ids[i], out.logprobs[i] = [int(tokens[first])], [lps[first]]
                if return_probs and i in dists:
                    out.probs[i] = dists[i]
                continue
            try:
                rows = logits[first:at]
                drafted = verify(rows, item.draft, item.draft_probs, seq.params, self.device.generator(seq))
                lp = torch.log_softmax(rows[:len(drafted)], -1).gather(
                    1, torch.tensor(drafted, device=rows.device)[:, None])
                out.token_ids[i], out.logprobs[i] = drafted, lp.squeeze(1).tolist()
            except Exception as exc:
                out.errors[i] = failure(seq, exc)
