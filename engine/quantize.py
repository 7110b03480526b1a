"""Quantization of the decoder's linear layers: weight-only int8 and int4, and fp8 (weights and
activations).

Formats (shared with the kernels in kernels/):
  int8: w int8 [N, K], scales [N]; symmetric per output channel: w ~= q * scale.
  int4: q 0..15 two per byte [N, K // 2] (low nibble = even k), scales and zeros [N, K // group];
        asymmetric per group: w ~= (q - zero) * scale.
  fp8:  w float8 e4m3 [N, K], scales [N]: per output channel, a row's largest weight at 448;
        activations are rounded to e4m3 too, per token, as the matmul runs. FP8 tensor cores
        (CUDA compute capability 8.9 and up: Ada, Hopper) multiply them on `torch._scaled_mm`;
        everywhere else the kernels' float32 emulation of the same rounding runs.
On CPU the matmuls run on torch's packed int8/int4 ops, which are fast only with bf16
activations, so activations are cast to bf16 just around them; norms, attention and sampling
stay in float32. Where integer dot products run (`dot_matmul`), a matmul over a few rows (decode)
quantizes its activations to int8 instead and sums their products with the weights in int32, as
llama.cpp does. Those ops compute rather than stream: their time grows with every row, so a
matmul over many rows (a prompt chunk) runs the kernels' float reference instead, on weights
dequantized a slice at a time (`dequant_rows`). Elsewhere (CUDA) they run on the kernels
package, from the stored format as is. Where a device's measured table says so (`bucket_ways`),
a decode batch bucket multiplies densely on a copy of the weights dequantized once instead, or
(int8, fp8) runs the Triton GEMV on a transposed copy of its own bytes.
"""
from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.model import CausalLM, Linear, Module, linear_sources
from kernels import (
    gemv_linear,
    gguf_cpu,
    gguf_matmul,
    gguf_quant,
    int4_matmul,
    int8_matmul,
    quant_matmul,
    quant_matmul_cpu,
)
from kernels import quantize_fp8 as quantize_fp8_rows
from kernels.cpu_build import vnni
from kernels.quant_matmul import unpack_int4


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    return (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, K = w.shape
    if K % group:
        raise ValueError(f"int4 group size {group} does not divide the layer's input size {K}")
    g = w.view(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = (hi - lo).clamp(min=1e-8) / 15
    zeros = -lo / scales                         # in quantized units: w = (q - zero) * scale
    q = (g / scales[..., None] + zeros[..., None]).round().clamp(0, 15).to(torch.uint8).view(N, K)
    return q[:, 0::2] | (q[:, 1::2] << 4), scales, zeros


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = quant_matmul.quantize_fp8(w)
    return q, scales.view(-1)


def dequantize(mode: str, tensors: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """A layer's stored format back in float32 [N, K]."""
    if mode == "int4":
        return quant_matmul.dequantize_int4(tensors["w"], tensors["scales"], tensors["zeros"], group)
    return tensors["w"].float() * tensors["scales"][:, None]


def fp8_native(device: torch.device) -> bool:
    """Whether `device` multiplies float8 on tensor cores (`torch._scaled_mm`): CUDA compute
    capability 8.9 (Ada) and up (Hopper 9.0)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class QuantLinear(Module):
    """A Linear whose weight is int8, int4 or fp8; built from the shared format above.

    `packed`: torch's packed op where the device has one, with bf16 activations around it:
    int8 and int4 on the CPU (int4 converted once here into its layout), int4 on CUDA (tinygemm,
    `_weight_int4pack_mm`, the kernel gpt-fast and torchao serve int4 with). Otherwise the
    kernels package (the Triton kernels on CUDA) on the shared format as stored. On the CPU, from
    `dot_rows` rows on, integer dot products (int4 keeps its stored format for them, which the
    packed op does not read, so it takes them from one row whenever `dot_rows` is not 0). From
    `dequant_rows` rows on (a prompt chunk), a layer that keeps the stored format multiplies
    densely over its dequantized weights instead: the quantized kernels stream weights, which
    pays for a few rows, and a dense GEMM computes, which pays for many. fp8 runs
    `torch._scaled_mm` where the device has FP8 tensor cores (`fp8_native`) and the layer's sizes
    are multiples of 16, else the kernels' emulation (`fp8_matmul`); its dequantized path is
    weight-only (activations not rounded). `ways`: for each row count below its length, "kernel"
    (the above), "dense" (on `dense_w`, the weights dequantized once into `dtype`) or, for int8
    and fp8, "gemv" (kernels.gemv_linear on `gemv_w`, the stored weights transposed to [in, out],
    each output's scale after the sum: weight-only, as dense is); a device's measured choice per
    decode batch bucket (`bucket_ways`). Past it, `dequant_rows` decides."""

    def __init__(self, mode: str, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None, group: int,
                 packed: bool = True, device: torch.device | str = "cpu", dequant_rows: int = 0, dot_rows: int = 0,
                 ways: tuple[str, ...] = (), dtype: torch.dtype = torch.float32):
        super().__init__()
        device = torch.device(device)
        if "gemv" in ways and mode not in GEMV_MODES:
            raise ValueError(f"the GEMV reads int8 or fp8 weights, not {mode}")
        self.mode, self.group, self.ways = mode, group, ways
        self.scaled_mm = mode == "fp8" and fp8_native(device) and all(d % 16 == 0 for d in tensors["w"].shape)
        dot = dot_matmul(mode, group) if dot_rows and device.type == "cpu" else None
        # How many activations share an int8 scale: int4's group; on the compiled int8 kernel a
        # block of the input (no dot products where it takes none), on `_int_mm` a whole row
        # (one int32 GEMM takes one scale per row).
        self.block = group if mode == "int4" else 0 if dot is quant_matmul.int8_int8_matmul else \
            quant_matmul.act_block(tensors["w"].shape[1])
        self.dot = dot if dot is quant_matmul.int8_int8_matmul or self.block else None
        self.dot_rows = 0 if self.dot is None else dot_rows if mode == "int8" else 1
        self.packed = packed and mode != "fp8" and (mode == "int8" or self.dot is None) and (
            device.type == "cpu" or (device.type == "cuda" and mode == "int4"
                                     and _tinygemm_tiles(*tensors["w"].shape) > 0))
        # The CPU's packed int8 layout is the stored one; int4's packed layouts are not.
        self.dequant_rows = dequant_rows if not self.packed or mode == "int8" else 0
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("dense_w", dequantize(mode, tensors, group).to(device, dtype) if "dense" in ways else None,
                             persistent=False)
        gemv = "gemv" in ways
        self.register_buffer("gemv_w", tensors["w"].t().contiguous().to(device) if gemv else None, persistent=False)
        self.register_buffer("gemv_scales", tensors["scales"].to(device, torch.float32) if gemv else None,
                             persistent=False)
        if not self.packed:
            for name in ("w", "scales", "zeros")[:3 if mode == "int4" else 2]:
                self.register_buffer(name, tensors[name].to(device), persistent=False)
            if mode == "int4":     # what the dot products take off for the zeros
                self.register_buffer("zero_scales", (self.zeros * self.scales).contiguous() if self.dot else None,
                                     persistent=False)
        elif mode == "int8":
            self.register_buffer("w", tensors["w"].to(device), persistent=False)
            self.register_buffer("scales", tensors["scales"].to(device, torch.bfloat16), persistent=False)
            # The packed op takes bf16 scales; the dot products apply float32 ones.
            self.register_buffer("dot_scales", tensors["scales"].to(device) if self.dot else None, persistent=False)
        else:
            q = unpack_int4(tensors["w"])
            if device.type == "cpu":
                w = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            else:   # tinygemm takes the even k in a byte's high nibble
                tiles = _tinygemm_tiles(*tensors["w"].shape)
                w = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(device), tiles)
            self.register_buffer("w", w.to(device), persistent=False)
            # Both packed int4 ops compute (q - 8) * scale + zero_point.
            scales, zeros = tensors["scales"], tensors["zeros"]
            packed_sz = torch.stack([scales, (8 - zeros) * scales], -1).transpose(0, 1).contiguous()
            self.register_buffer("scales_and_zeros", packed_sz.to(device, torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Buffers read from _buffers: nn.Module's attribute fallback costs microseconds a lookup,
        # and a 1.5B decode step makes some 500 of them here.
        b, rows = self._buffers, x.shape[0]
        way = self.ways[rows] if rows < len(self.ways) else "dense" if 0 < self.dequant_rows <= rows else "kernel"
        if way == "gemv":
            return gemv_linear(x, b["gemv_w"], b["bias"], b["gemv_scales"])
        if way == "dense" and b["dense_w"] is not None:     # the bias in cuBLAS's epilogue, not a kernel of its own
            return torch.nn.functional.linear(x, b["dense_w"], b["bias"])
        if way == "dense":      # int8's reference serves fp8's e4m3 weights too: both are x @ (w * scale).T
            y = (quant_matmul.int4_matmul(x, b["w"], b["scales"], b["zeros"], self.group) if self.mode == "int4"
                 else quant_matmul.int8_matmul(x, b["w"], b["scales"]))
        elif 0 < self.dot_rows <= rows:
            y = (self.dot(x, b["w"], b["dot_scales" if self.packed else "scales"], self.block) if self.mode == "int8"
                 else self.dot(x, b["w"], b["scales"], b["zero_scales"], self.group))
        elif self.mode == "fp8":
            y = fp8_scaled_mm(x, b["w"], b["scales"]) if self.scaled_mm else quant_matmul.fp8_matmul(
                x, b["w"], b["scales"])
        elif not self.packed:
            y = (int8_matmul(x, b["w"], b["scales"]) if self.mode == "int8"
                 else int4_matmul(x, b["w"], b["scales"], b["zeros"], self.group))
        else:
            xb = x.to(torch.bfloat16)
            if self.mode == "int8":
                y = torch._weight_int8pack_mm(xb, b["w"], b["scales"])
            elif x.is_cuda:
                y = torch._weight_int4pack_mm(xb, b["w"], self.group, b["scales_and_zeros"])
            else:
                y = torch._weight_int4pack_mm_for_cpu(xb, b["w"], self.group, b["scales_and_zeros"])
            y = y.to(x.dtype)
        return y if b["bias"] is None else y + b["bias"]

    @property
    def row_block(self) -> int:
        """`rows` takes whole aligned blocks of this many outputs: torch's packed int4 layouts
        interleave rows within them (tinygemm's in tiles of 8)."""
        if not (self.packed and self.mode == "int4"):
            return 1
        return 8 if self.w.is_cuda else row_block()

    def rows(self, ids: torch.Tensor) -> QuantLinear:
        """This layer computing only the outputs `ids` (a copy of their weights), in whole
        aligned blocks of `row_block`."""
        sub = copy.copy(self)
        tiles = self.packed and self.mode == "int4" and self.w.is_cuda      # w is [N / 8, ...]
        sub._buffers = {name: None if b is None else
                        b.index_select(0, ids[::8] // 8) if name == "w" and tiles else
                        b.index_select(1 if name in ("scales_and_zeros", "gemv_w") else 0, ids)
                        for name, b in self._buffers.items()}
        return sub


def fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8_matmul on FP8 tensor cores: x rounded as its twin rounds it, then one `_scaled_mm`
    with row-wise scales (x's per row [M, 1], the weights' per output [1, N]; w [N, K] row-major
    is the column-major [K, N] operand it takes). Row-wise scales take a bf16 output. On CUDA x
    is rounded in one Triton launch, not the twin's eight tensor operations."""
    xq, x_scale = quantize_fp8_rows(x)
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scales[None], out_dtype=torch.bfloat16).to(x.dtype)


def _tinygemm_tiles(n: int, half_k: int) -> int:
    """The inner k-tiles tinygemm packs an [n, 2 * half_k] int4 weight with (the most its k
    allows); 0 where its layout cannot hold the layer (n not a multiple of 8)."""
    k = 2 * half_k
    return 0 if n % 8 else next((t for t in (8, 4, 2) if k % (16 * t) == 0), 0)


@functools.cache
def row_block() -> int:
    """The row block of torch's packed int4 CPU layout, which interleaves output rows within it:
    its size follows the kernel torch dispatches to (32 under AVX2, 64 under AVX-512), so it is
    found by packing rather than assumed. A layer restricted to some rows (`rows`) takes whole
    blocks of it."""
    w = torch.randint(0, 16, (256, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    whole = torch._convert_weight_to_int4pack_for_cpu(w, 1)
    return next(b for b in (16, 32, 64, 128, 256)
                if all(torch.equal(whole[i:i + b],
                                   torch._convert_weight_to_int4pack_for_cpu(w[i:i + b].contiguous(), 1))
                       for i in range(0, 256, b)))


# From how many rows a quantized matmul runs densely on its dequantized weights (the kernels'
# float reference twin), per device. CPU: torch's packed int8 op computes rather than streams,
# and benchmarks/prefill_bench.py measured float32 faster from prompts of 128 tokens on an AVX2
# host (1.4-1.7x) and on an AVX-512 one (1.3-1.6x). CUDA (int8; int4 runs tinygemm): the Triton
# kernel reads the weight once per 64-row tile, so past some tiles cuBLAS over weights converted
# to bf16 wins; benchmarks/gpu_kernels.py on an H100, Qwen2.5-1.5B's layers: at 256 rows the
# Triton tiles were faster on every one (1.2-1.8x), at 1,024 cuBLAS was on all but the q|k|v
# projection (1.1-1.9x). 0 turns it off.
DEQUANT_ROWS = {"cpu": 64, "cuda": 512}


def dequant_rows_default(device: str, mode: str, group: int, dot_rows: int) -> int:
    """DEQUANT_ROWS for the device, except where a prompt's matmuls run on the compiled AVX2
    integer kernels (`dot_rows` not 0): there the kernels stay faster than dequantized float32 at
    every row count (cache-tiled, benchmarks/prefill_bench.py), and nothing dequantizes. fp8
    never: FP8 tensor cores compute at twice bf16's rate, so prompts gain the most, and on the
    CPU its emulation multiplies dense float32 weights already."""
    if mode == "fp8" or (device == "cpu" and dot_rows
                         and dot_matmul(mode, group) not in (None, quant_matmul.int8_int8_matmul)):
        return 0
    return DEQUANT_ROWS[device]


# Per CUDA device (its torch name), per precision, per decode batch bucket: whether a layer runs
# its own kernel, multiplies densely on its weights dequantized once into the compute dtype (a
# copy held beside the quantized ones), or (int8, fp8) runs the Triton GEMV on its own bytes.
# benchmarks/gpu_kernels.py measures each at the served models' layer shapes and writes the
# fastest into this file; without it, or without the device
# in it, every precision runs its kernel at every decode batch (ModelEntry.dense_buckets: off).
# bf16 ("bf16.<layer kind>") chooses the same way between the Triton GEMV and cuBLAS.
BUCKETS = Path(__file__).with_name("precision_buckets.json")
GEMV_MODES = ("int8", "fp8")     # the precisions whose weights the Triton GEMV reads (one scale per output)


def bucket_ways(mode: str, device_name: str, table: Path = BUCKETS) -> tuple[str, ...]:
    """From `table`, how `mode`'s layers multiply at each row count up to the largest bucket
    measured on `device_name` ("kernel", "dense", or for int8 and fp8 "gemv"): a row count takes
    the choice of the smallest bucket measured at or above it (the CUDA graph it pads to). Empty
    where the table has no such entry: rows past the buckets follow `dequant_rows`."""
    if not table.is_file():
        return ()
    entry = json.loads(table.read_text()).get("devices", {}).get(device_name, {}).get("buckets", {}).get(mode)
    if not entry:
        return ()
    allowed = ("kernel", "dense", "gemv") if mode in GEMV_MODES else ("kernel", "dense")
    if not set(entry.values()) <= set(allowed):
        raise ValueError(f"{table}: {device_name} {mode}: each bucket picks one of {', '.join(allowed)}; "
                         f"got {sorted(set(entry.values()))}")
    buckets = sorted((int(b), pick) for b, pick in entry.items())
    return tuple(next(way for b, way in buckets if b >= rows) for rows in range(buckets[-1][0] + 1))


def apply_gemv_buckets(model: CausalLM, device_name: str, table: Path = BUCKETS) -> dict[str, tuple[bool, ...]]:
    """A bf16 model's float Linears choose per decode batch bucket between cuBLAS and the Triton
    GEMV (`Linear.gemv_rows`), each as `table` says for its kind on `device_name` ("bf16.qkv",
    "bf16.o", "bf16.gate_up", "bf16.down", "bf16.lm_head": "kernel" is the GEMV, "dense" cuBLAS).
    Returns the picks of the kinds that run the GEMV somewhere; a kind without an entry, or a
    model in another dtype, stays on cuBLAS as it is built."""
    if model.norm.weight.dtype != torch.bfloat16:
        return {}
    picks: dict[str, tuple[bool, ...]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            kind = name.rpartition(".")[2].removesuffix("_proj")
            if kind not in picks:
                picks[kind] = tuple(way == "kernel" for way in bucket_ways(f"bf16.{kind}", device_name, table))
            module.gemv_rows = picks[kind]
    return {kind: rows for kind, rows in picks.items() if any(rows)}


@functools.cache
def dot_matmul(mode: str, group: int):
    """Integer dot products on this CPU for `mode`'s weights, or None: the compiled kernels
    (kernels/quant_matmul_cpu.py; int4 groups of a multiple of 32) wherever they build, the same
    arithmetic on every x86 host; int8 falls back to torch's `_int_mm` where they do not build but
    oneDNN has VNNI kernels (torch's `_int_mm` without VNNI was 0.05-0.44x the packed op on an
    AVX2 host). A decode step's matmuls at 1 row, against torch's packed op (medians of 7 steps):
    int4 1.86-2.03x on the AVX2 EPYC (gemm_bench.json), 1.39-1.56x on an AVX-512 VNNI EPYC
    (gemm_bench-avx512-epyc.json), 0.71-0.83x on the GPU machines' AVX-512 Xeon
    (gemm_bench-avx512-2t.json), a host where the GPU serves and the CPU does not. int8 on that
    EPYC, where `_int_mm` served before: the compiled kernel 1.57-1.70x `_int_mm` at 1 row and
    1.22-1.32x at 8, with a scale per 128 activations rather than per row. `_int_mm` computes
    faster from 16 rows (one layer, weights in cache), but its per-row scale gave the down
    projections 3.5-4.5x the error of 128-value blocks (benchmarks/act_quant_error.py), so
    prompts stay on the compiled kernel too. fp8 has none: its activations are e4m3, not int8."""
    if mode == "fp8" or (mode == "int4" and group % 32):
        return None
    compiled = quant_matmul_cpu.load()
    if compiled is None:
        return quant_matmul.int8_int8_matmul if mode == "int8" and torch.cpu._is_vnni_supported() else None
    return (compiled.int8_linear if mode == "int8" else compiled.int4_linear).default


def dot_vnni() -> bool:
    """Whether the compiled integer kernels serve here built with AVX-512 VNNI (kernels/cpu_build.py)."""
    return quant_matmul_cpu.load() is not None and vnni()


def dot_rows_default() -> int:
    """From how many rows an int8 matmul on this CPU runs on integer dot products (ModelEntry.
    dot_rows left out), up to dequant_rows; int4 runs on them from one row whenever this is not
    0 (and `dot_matmul` has a kernel for it). Measured (benchmarks/gemm_bench.py, 2 threads, a
    decode step's matmuls): the compiled kernel won from one row against the packed op on an
    AVX2 EPYC (1.72-2.04x, 2.36-2.75x at eight) and on an AVX-512 VNNI EPYC (1.70-1.92x,
    2.11-2.35x at eight, gemm_bench-avx512-epyc.json); where only
    `_int_mm` serves, it matched the packed op at one row on an AVX-512 VNNI Xeon (1.00-1.03x)
    and won at eight (2.05-2.38x)."""
    if quant_matmul_cpu.load() is not None:
        return 1
    return 4 if torch.cpu._is_vnni_supported() else 0


log = logging.getLogger(__name__)


# Up to how many rows a GGUF layer on CUDA runs the Triton kernel on its blocks; more (a prompt
# chunk) multiply its weights dequantized. A first guess, which benchmarks/gpu_kernels.py's
# "Q4_K triton" rows against "bf16" measure on a device.
GGUF_TRITON_ROWS = 16


class GGUFLinear(Module):
    """A Linear on the GGUF's own quantized blocks, kept as stored (kernels/gguf_quant.py): no
    float copy, no second quantization. `parts`: (type, uint8 [rows, row_bytes]) in output
    order; a fused projection may mix types (the 0.5B's v rows are Q8_0, its q and k Q5_0), and
    consecutive parts of one type are one tensor. On the CPU the compiled kernel computes every
    row count on integer dot products (csrc/gguf_linear.cpp), so a row's output never depends on
    the batch it is in. On CUDA the Triton kernel reads the blocks up to `triton_rows` rows (a
    decode batch; `apply_gguf` hands it Q6_K, Q5_0 and Q8_0 in their aligned planar layouts) and
    a prompt's rows multiply the weights dequantized; elsewhere the weights are dequantized a
    slice at a time."""

    row_block = 1

    def __init__(self, parts: list[tuple[str, torch.Tensor]], bias: torch.Tensor | None,
                 device: torch.device | str = "cpu", triton_rows: int = GGUF_TRITON_ROWS,
                 steps: int = 1):
        super().__init__()
        merged: list[tuple[str, torch.Tensor]] = []
        for qtype, w in parts:
            if merged and merged[-1][0] == qtype:
                merged[-1] = (qtype, torch.cat([merged[-1][1], w]))
            else:
                merged.append((qtype, w))
        self.types = [qtype for qtype, _ in merged]
        for i, (_, w) in enumerate(merged):
            self.register_buffer(f"w{i}", w.to(device).contiguous(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        # The compiled kernel reads its types by id; a GPU layout is not one of them.
        cpu_types = all(t in gguf_quant.TYPES for t in self.types)
        ops = gguf_cpu.load() if torch.device(device).type == "cpu" and cpu_types else None
        self.compiled = None if ops is None else ops.gguf_linear.default
        self.ids = [gguf_quant.TYPES[t].id for t in self.types] if cpu_types else []
        self.triton_rows, self.steps = triton_rows, steps      # steps: the compiled kernel's (quantize_steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        if self.compiled is not None and x.dtype == torch.float32:      # the bias added in the kernel
            return self.compiled(x, self.parts(), self.ids, b["bias"], self.steps)
        matmul = gguf_matmul if x.shape[0] <= self.triton_rows else gguf_quant.gguf_matmul
        ys = [matmul(x, w, t) for w, t in zip(self.parts(), self.types)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if b["bias"] is None else y + b["bias"]

    def parts(self) -> list[torch.Tensor]:
        return [self._buffers[f"w{i}"] for i in range(len(self.types))]

    def rows(self, ids: torch.Tensor) -> GGUFLinear:
        """This layer computing only the outputs `ids` (a copy of their blocks)."""
        if len(self.types) != 1:
            raise ValueError("rows() takes a layer of one type (the LM head)")
        sub = copy.copy(self)
        sub._buffers = {"w0": self.w0.index_select(0, ids),
                        "bias": None if self.bias is None else self.bias.index_select(0, ids)}
        return sub


class GGUFEmbedding(Module):
    """The token embedding read from its stored blocks: a lookup dequantizes only the rows it
    reads (equal to the float table's rows to the bit); a tied LM head reads the same bytes."""

    def __init__(self, qtype: str, w: torch.Tensor, dim: int, dtype: torch.dtype):
        super().__init__()
        self.qtype, self.dim, self.dtype = qtype, dim, dtype
        self.register_buffer("weight", w, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gguf_quant.dequantize(self.weight.index_select(0, ids.flatten()), self.qtype, self.dim).to(
            self.dtype).view(*ids.shape, self.dim)


def apply_gguf(model: CausalLM, folder: Path, blocks: Path, steps: int, steps_on: tuple[str, ...]) -> CausalLM:
    """Swap the model's Linears (and its embedding) for ones on the GGUF's own blocks (`blocks`,
    models/convert.py's file: uint8 tensors named as the Hugging Face weights, their types in
    its metadata). A tensor of a type no kernel reads serves in float32 from the folder's float
    weights, with a warning naming it: slower, never wrong. `steps`: on the CPU kernel, the
    K-quants' activation steps per block (kernels/gguf_quant.py's quantize_steps) in the
    projections named in `steps_on` (ModelEntry.gguf_steps_on); one elsewhere."""
    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    with safe_open(blocks, framework="pt") as f:
        types = f.metadata()
        stored = set(f.keys())

        @functools.cache    # a tied head reads the embedding's own bytes, not a copy
        def part(hf: str) -> tuple[str, torch.Tensor] | None:
            if hf not in stored:
                return None
            if types[hf] not in gguf_quant.FILE_TYPES:
                log.warning("%s: tensor %s is %s, which no kernel reads as stored; it serves in float32",
                            folder, hf, types[hf])
                return None
            qtype, w = types[hf], f.get_tensor(hf).to(device)
            if device.type != "cpu":        # the Triton kernel's aligned layout, where the type has one
                return gguf_quant.to_planes(qtype, w)
            # On the CPU, in its kernel's faster layout (the same values), and in memory of its
            # own: a tensor read here is a view of the file's mapping, and a view kept would hold
            # the whole file resident for as long as the model lives.
            layout, w2 = gguf_quant.repack(qtype, w)
            return layout, w2.clone() if w2 is w else w2

        embed = part("model.embed_tokens.weight")
        model.embed_tokens = GGUFEmbedding(*embed, model.cfg.hidden_size, dtype) if embed is not None else \
            torch.nn.Embedding.from_pretrained(_float(folder, ["model.embed_tokens.weight"]).to(device, dtype))
        for name, module, bases in linear_sources(model):
            parent, _, child = name.rpartition(".")
            sources = [f"{b}.weight" for b in bases]
            if name == "lm_head" and model.cfg.tie_embeddings:
                sources = ["model.embed_tokens.weight"]
            parts = [part(s) for s in sources]
            if any(p is None for p in parts):
                _float_weights(module, folder, sources, device, dtype)
                continue
            bias = None if module.bias is None else module.bias.data
            layer = GGUFLinear(parts, bias, device, steps=steps if child in steps_on else 1)
            setattr(model.get_submodule(parent) if parent else model, child, layer)
    return model


def _float(folder: Path, names: list[str]) -> torch.Tensor:
    """The folder's float weights `names`, concatenated along the rows."""
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            found |= {n: f.get_tensor(n) for n in names if n in f.keys()}
    return torch.cat([found[n] for n in names])


def _float_weights(module: Linear, folder: Path, sources: list[str], device, dtype) -> None:
    """Fill a Linear left on the meta device with its float weights from the folder."""
    module.weight_t = torch.nn.Parameter(_float(folder, sources).t().contiguous().to(device, dtype),
                                         requires_grad=False)


def quantize_tensors(model: CausalLM, mode: str, group: int) -> dict[str, torch.Tensor]:
    """Every decoder Linear (the LM head too) in the shared format, keyed by module name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            w = module.weight_t.t().contiguous()
            if mode in ("int8", "fp8"):
                q, s = quantize_int8(w) if mode == "int8" else quantize_fp8(w)
                out |= {f"{name}.w": q, f"{name}.scales": s}
            else:
                q, s, z = quantize_int4(w, group)
                out |= {f"{name}.w": q, f"{name}.scales": s, f"{name}.zeros": z}
    return out


def apply_quantization(model: CausalLM, mode: str, group: int = 128, cache: Path | None = None,
                       dequant_rows: int = 0, dot_rows: int = 0, buckets: Path | None = None) -> CausalLM:
    """Swap the model's Linears for quantized ones (mode "int8", "int4" or "fp8"); with `cache`,
    quantize once and reuse. `dequant_rows`: matmuls over at least this many rows on a stored
    format dequantize (0: never). `dot_rows`: on the CPU, matmuls over at least this many rows
    run on integer dot products (0: never; int4 from one row when not 0). `buckets`: on CUDA, the
    measured table of `bucket_ways` (None: none)."""
    if cache is not None and cache.exists():
        # Copies, not views of the file: torch's int8 kernel segfaults on weights that are not
        # aligned as its own allocator aligns them.
        tensors = {k: v.clone() for k, v in load_file(cache).items()}
    else:
        tensors = quantize_tensors(model, mode, group)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            save_file(tensors, tmp)
            tmp.rename(cache)
    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    ways = bucket_ways(mode, torch.cuda.get_device_name(device), buckets) if buckets and device.type == "cuda" else ()
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            parent, _, child = name.rpartition(".")
            own = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
            bias = None if module.bias is None else module.bias.data
            layer = QuantLinear(mode, own, bias, group, device=device, dequant_rows=dequant_rows,
                                dot_rows=dot_rows, ways=ways, dtype=dtype)
            setattr(model.get_submodule(parent) if parent else model, child, layer)
    return model
