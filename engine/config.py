"""Configuration: the engine's (msgspec, validated at the boundary) and a model's
architecture (read from a Hugging Face ``config.json``)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


class ThinkingConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The model's thinking span. A native thinker (Qwen3) opens it itself; for the others the
    span is prompted with `instruction`, with the same markers."""
    open: str = "<think>"
    close: str = "</think>"
    # What budget forcing writes before the closing marker (Qwen3's own wording).
    nudge: str = ("\n\nConsidering the limited time by the user, I have to give the solution "
                  "based on the thinking directly now.\n")
    native: bool = False
    instruction: str = ("First think step by step between <think> and </think>. "
                        "After </think>, give only the final answer.")

    @property
    def forced(self) -> str:
        """What budget forcing writes when the budget is spent."""
        return f"{self.nudge}{self.close}\n\n"

    @property
    def early_close(self) -> str:
        """What closes a span whose answer has settled (early exit), and what a probe appends to
        read that answer: the marker on a line of its own, no nudge (nothing was cut short)."""
        return f"\n{self.close}\n\n"


# Weights: float, quantized from float (int8, int4 weight-only; fp8 weights and activations), the
# GGUF's own blocks as they ship (gguf), or a 4-bit AWQ or GPTQ checkpoint's own integers on the
# int4 kernels (awq, gptq; engine/awq_gptq.py); "auto": the device's default, chosen where the
# engine loads (engine/worker.py's default_quant: gguf on the CPU, int8 on CUDA), so that a
# config written on one machine (a Ray driver) means the right thing on the replica's device.
QUANT_SCHEMES = ("auto", "none", "int8", "int4", "fp8", "gguf", "awq", "gptq")
MAX_GGUF_STEPS = 8      # kernels/gguf_quant.py's MAX_STEPS (config stays free of torch)
GGUF_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")   # engine/model.py's Linears
GGUF_STEPS, GGUF_STEPS_ON = 1, ("gate_up_proj",)      # ModelEntry's defaults (why: its comment)
FLOAT_DTYPES = ("float32", "bfloat16")       # compute dtypes, and unquantized KV


class ModelEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One model the engine serves: a store name ("qwen2.5-coder-0.5b"), a Hugging Face
    folder or a GGUF file."""
    source: str
    # Share of the KV memory this model gets, relative to the other models' shares.
    kv_share: float = 1.0
    # "auto": the device's default (QUANT_SCHEMES' comment); weight-only:
    # "none" | "int8" | "int4" | "gguf" (a GGUF's own blocks) | "awq" | "gptq" (the
    # checkpoint's own int4 weights, in its own group size); "fp8": float8 e4m3 weights (per output
    # channel) and activations (per token), on torch._scaled_mm on CUDA devices of compute
    # capability 8.9 and up, elsewhere an exact float32 emulation (slow: a quality check)
    quant: str = "none"
    group_size: int = 128         # int4 group along the input dimension, quantizing float weights: 32, 64 or 128
    # A step of at least this many tokens (a prompt chunk) multiplies densely over dequantized
    # weights instead of on the quantized kernel (int8 on the CPU, int8 and float32 int4 on CUDA);
    # 0: the quantized kernel always; None: engine/quantize.py's dequant_rows_default (DEQUANT_ROWS
    # for the device, 0 where the compiled AVX2 integer kernels serve).
    dequant_rows: int | None = None
    # On the CPU, a quantized matmul over at least this many rows (and fewer than dequant_rows)
    # runs on integer dot products, the activations quantized to int8, instead of torch's
    # packed op on bf16 activations (int4 from one row whenever this is not 0: its packed layout
    # is the alternative, chosen at load); 0: never; None: engine/quantize.py's dot_rows_default
    # for the CPU (its ISA, and whether the compiled kernels build).
    dot_rows: int | None = None
    # On CUDA, int8 / int4 / fp8 choose per decode batch bucket between their kernel and a dense
    # matmul on their weights dequantized once (a copy in the compute dtype), as the device's
    # measured table says (engine/precision_buckets.json, written by benchmarks/gpu_kernels.py);
    # no table, or False: their kernel at every decode batch. A bf16 model's layers choose the
    # same way between cuBLAS and the Triton GEMV (kernels/gemv_triton.py); False: cuBLAS.
    dense_buckets: bool = True
    # quant "gguf" on the CPU: 1, a K-quant's activations on one int8 scale per 256 values, as
    # llama.cpp's q8_K; up to 8, a step per 32 of them, 1 to this many times that scale
    # (kernels/gguf_quant.py's quantize_steps), in the projections `gguf_steps_on` names. The
    # MLP's gate|up reads the post-attention norm's output, where Qwen's outlier channels are:
    # the 1.5B's perplexity on float32's at 8 steps there is +0.06%, against +0.38% at 1 and
    # +0.05% at 8 in every projection, each projection's prompts and batches slower (docs/engine.md).
    gguf_steps: int = GGUF_STEPS
    gguf_steps_on: tuple[str, ...] = GGUF_STEPS_ON
    thinking: ThinkingConfig = ThinkingConfig()

    def __post_init__(self) -> None:
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"model {self.source!r}: quant must be one of {', '.join(QUANT_SCHEMES)}, "
                             f"got {self.quant!r}")
        if self.dequant_rows is not None and self.dequant_rows < 0:
            raise ValueError(f"model {self.source!r}: dequant_rows must be 0 (off), a row count or left out "
                             f"(the measured default), got {self.dequant_rows}")
        if not 1 <= self.gguf_steps <= MAX_GGUF_STEPS:
            raise ValueError(f"model {self.source!r}: gguf_steps must be 1 (one int8 scale per 256 activations) to "
                             f"{MAX_GGUF_STEPS}, got {self.gguf_steps}")
        if unknown := set(self.gguf_steps_on) - set(GGUF_PROJECTIONS):
            raise ValueError(f"model {self.source!r}: gguf_steps_on names projections of "
                             f"{', '.join(GGUF_PROJECTIONS)}, got {', '.join(sorted(unknown))}")
        if self.dot_rows is not None and self.dot_rows < 0:
            raise ValueError(f"model {self.source!r}: dot_rows must be 0 (off), a row count or left out "
                             f"(the measured default), got {self.dot_rows}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"model {self.source!r}: group_size must be 32, 64 or 128, got {self.group_size}")


class SpecConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Speculative decoding for one target model. Every source has its own off switch."""
    target: str                        # name of the model that verifies
    draft: str | None = None           # name of the draft model (same tokenizer); None: no model drafts
    prompt_lookup: bool = True         # n-gram drafts from the sequence itself
    # Most tokens one proposal may hold: on CPU a verify pass over 1-3 rows costs about a plain
    # step, over 5 twice that (benchmarks/verify_bench.py), which the cost model cannot see.
    max_k: int = 2
    max_external_k: int = 16           # an external draft is cheap: verify more of it per pass
    # The draft model proposes only the first this many token ids (byte-pair ranks, most
    # frequent first) and its stop tokens, through a head that small (docs/engine.md has what
    # that covers and saves for Qwen2.5-0.5B). 0: the whole vocabulary.
    draft_vocab: int = 65536
    min_ngram: int = 2
    max_ngram: int = 4
    # Costs relative to a plain target step, of verifying one more token and of one draft-model
    # step; None: measured as it runs.
    verify_cost: float | None = None
    draft_cost: float | None = None
    draft_prefill_cost: float | None = None     # per token the draft model must catch up on
    probe_every: int = 16              # steps a sequence waits with speculation off before trying again
    # Measure decoding with and without drafts (model and lookup) side by side and keep the
    # faster, per batch size: the off switch when the cost model is wrong on this machine.
    govern: bool = True


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    models: dict[str, ModelEntry]
    # One budget for weights plus KV across all models; KV gets what the weights leave.
    memory_budget_gb: float = 12.0
    # Cap KV blocks per model so tests and laptops do not reserve all the budget.
    max_kv_blocks: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512      # per step and model: decodes + prefill chunks
    max_num_seqs: int = 64
    prefix_caching: bool = True
    # "auto": unquantized, in the compute dtype (float32 on the CPU, bfloat16 on CUDA); an explicit
    # float dtype must equal the compute dtype. "int8" quarters float32 KV (one scale per token and head).
    kv_cache_dtype: str = "auto"
    # Steps a waiting request may be overtaken by later, smaller ones before it blocks them.
    max_wait_steps: int = 32
    num_threads: int | None = None
    speculative: SpecConfig | None = None
    # Where the engine runs: "auto" (CUDA when available, else the CPU), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # Compute dtype: "auto" is bfloat16 on CUDA and float32 on the CPU (dense bf16 matmuls are ~50x
    # slower there); or "float32", "bfloat16".
    dtype: str = "auto"
    # On CUDA the memory budget (weights first, then KV) is this share of the device's free memory at
    # start-up; memory_budget_gb is the CPU's budget.
    gpu_memory_utilization: float = 0.9
    # Decode-only steps replay CUDA graphs captured at start-up per padded batch size; False: eager.
    cuda_graphs: bool = True
    # On the CPU in float32, a layer's norms, rotary, SiLU product and decode attention run as
    # compiled kernels (kernels/layer_cpu.py: one call each instead of a dozen small operators);
    # False: their PyTorch twins. Per engine: another engine in the process keeps its own choice.
    cpu_kernels: bool = True
    # With those kernels, a decode-only step runs the decoder's layers in one compiled call
    # (engine/cpu_step.py: the CPU's counterpart of cuda_graphs, no Python between operators);
    # False: the layers call their operators from Python.
    cpu_step: bool = True
    # Async scheduling (vLLM v1's): a step's forward and sampling run on a queue of their own while
    # the host plans and prepares the next step, each decoding sequence assumed to produce its one
    # token (a placeholder the queue fills in); outputs come back a step later. Off for an engine
    # with speculative decoding (a verification's accepted count decides the next step). Off until
    # a real forward measures it: only a stubbed one has (docs/engine.md), never a GPU's.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("engine config: 'models' is empty; name at least one model")
        spec = self.speculative
        for role, name in (("target", spec and spec.target), ("draft", spec and spec.draft)):
            if name and name not in self.models:
                raise ValueError(f"engine config: speculative {role} {name!r} is not one of the models "
                                 f"({', '.join(self.models)})")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"engine config: block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_dtype not in ("auto", *FLOAT_DTYPES, "int8"):
            raise ValueError(f"engine config: kv_cache_dtype must be auto, float32, bfloat16 or int8, "
                             f"got {self.kv_cache_dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"engine config: device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("auto", *FLOAT_DTYPES):
            raise ValueError(f"engine config: dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine config: gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("engine config: max_num_batched_tokens must be at least block_size")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_embeddings: bool
    attention_bias: bool      # Qwen2: bias on q, k, v
    qk_norm: bool             # Qwen3: RMSNorm on q and k per head
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"model_type {arch!r} is not supported; expected one of {SUPPORTED_ARCHS}")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = d["num_attention_heads"]
        # transformers 5 folds rope_theta and rope_scaling into one rope_parameters dict.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        return cls(
            arch=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"], num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=rope or None,
            max_position=d.get("max_position_embeddings", 4096), tie_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or bool(d.get("attention_bias")), qk_norm=arch == "qwen3",
            eos_token_ids=eos_ids)

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        return cls.from_hf(json.loads((folder / "config.json").read_text()))
