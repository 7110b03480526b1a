"""AWQ and GPTQ checkpoints served on the engine's int4 kernels, from their own integers.

A Hugging Face folder quantized with AutoAWQ (GEMM) or AutoGPTQ / optimum stores each linear
layer as 4-bit integers packed eight to an int32, with a float16 scale and a 4-bit zero per group
of inputs: w = (q - zero) * scale, which is engine/quantize.py's int4 format in another packing.
Unpacking is exact, so a layer computes on the checkpoint's own values: nothing is dequantized on
the way and nothing is quantized a second time. The packings, for a layer of K inputs and N outputs:

  AWQ   qweight int32 [K, N / 8]: nibble i (bits 4i..4i+3) of column c holds output 8c + AWQ_ORDER[i]
        qzeros  int32 [K / group, N / 8], in the same order; scales fp16 [K / group, N]
  GPTQ  qweight int32 [K / 8, N]: nibble j of row r holds input 8r + j
        qzeros  int32 [K / group, N / 8]: nibble j of column c holds output 8c + j, as zero - 1 in
                the v1 format (checkpoint_format "gptq", and every checkpoint that names none)
        scales fp16 [K / group, N]; g_idx int32 [K]: each input's group, k // group unless the
                layer was quantized in activation order (desc_act)
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model import CausalLM, linear_sources, load_model
from engine.quantize import QuantLinear, dequant_rows_default, dot_rows_default

METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # AutoAWQ's GEMM packing: the outputs its kernel unpacks together
GROUPS = (32, 64, 128)                  # what the int4 kernels take
# Where the libraries' older versions state the quantization, before transformers read it from
# config.json: AutoGPTQ's file, and AutoAWQ's (with its own key names, w_bit and q_group_size).
LEGACY_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Scheme:
    """A folder's quantization as its config.json states it."""
    method: str                 # "awq" | "gptq"
    group: int
    zero_offset: int = 0        # added to each stored zero: GPTQ's v1 format stores zero - 1
    desc_act: bool = False


def scheme(folder: Path, quant: str) -> Scheme | None:
    """The folder's stored quantization (config.json's quantization_config, or LEGACY_FILES), for
    ModelEntry.quant `quant`: None for a float folder under a float precision. A quantization the
    int4 kernels cannot take as stored (another method or bit width, a group they do not compute,
    another packing), or one that disagrees with `quant`, is an error naming the folder and the
    setting."""
    qc, source = json.loads((folder / "config.json").read_text()).get("quantization_config"), \
        "config.json quantization_config"
    for name, method in LEGACY_FILES.items():
        if qc is None and (folder / name).is_file():
            qc, source = {"quant_method": method} | json.loads((folder / name).read_text()), name
    if qc is None:
        if quant in METHODS:
            raise ValueError(f"{folder}: quant {quant!r} serves a 4-bit {quant} checkpoint's own weights, and "
                             f"config.json has no quantization_config (a float checkpoint); choose int4 to "
                             f"quantize it")
        return None
    where = f"{folder}: {source}"
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"{where} quant_method {method!r} is not supported; Sluice serves 4-bit awq and gptq "
                         f"checkpoints, or float ones")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where} bits = {bits}: only 4-bit {method} checkpoints load onto the int4 kernels")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in GROUPS:
        raise ValueError(f"{where} group_size = {group}: the int4 kernels take groups of "
                         f"{', '.join(map(str, GROUPS))}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where} version = {version!r}: only AutoAWQ's gemm packing is read")
        if qc.get("zero_point", True) is not True:
            raise ValueError(f"{where} zero_point = {qc['zero_point']}: only AWQ with zero points is read")
        found = Scheme("awq", group)
    else:
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where} checkpoint_format = {fmt!r}: only gptq (v1) and gptq_v2 packings are read")
        found = Scheme("gptq", group, 1 if fmt == "gptq" else 0, bool(qc.get("desc_act")))
    if quant != method:
        raise ValueError(f"{folder} is a 4-bit {method} checkpoint ({source}); serve it "
                         f"with quant {method!r} (its own weights), not {quant!r}")
    return found


def unpack(scheme: Scheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
           ) -> dict[str, torch.Tensor]:
    """One layer's packed tensors in QuantLinear's int4 format: w uint8 [N, K / 2] (low nibble = even
    k), scales and zeros float32 [N, K / group]. Exact: the same integers, the fp16 scales widened."""
    n = scales.shape[1]
    if scheme.method == "awq":
        order = torch.argsort(torch.tensor(AWQ_ORDER))      # output j sits in nibble order[j]
        q = _nibbles(qweight)[..., order].reshape(-1, n).t()
        zeros = _nibbles(qzeros)[..., order].reshape(-1, n)
    else:
        q = _nibbles(qweight).permute(1, 0, 2).reshape(n, -1)
        zeros = _nibbles(qzeros).reshape(-1, n)
    return {"w": (q[:, 0::2] | q[:, 1::2] << 4).contiguous(), "scales": scales.t().float().contiguous(),
            "zeros": (zeros.t().float() + scheme.zero_offset).contiguous()}


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> uint8 [..., M, 8]: the eight 4-bit values of each, lowest bits first."""
    return ((packed.unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8)


def load(folder: Path, cfg: ModelConfig, scheme: Scheme, device: torch.device, dtype: torch.dtype,
         dequant_rows: int | None = None, dot_rows: int | None = None) -> CausalLM:
    """The model with each quantized Linear a QuantLinear("int4") on the checkpoint's integers (fused
    projections concatenated along the outputs, as the float weights are); what the checkpoint
    keeps in float (embeddings, norms, biases, usually the LM head) loads as a float model's does.
    `dequant_rows`, `dot_rows`: as ModelEntry's (None: the measured defaults)."""
    dot = dot_rows_default() if dot_rows is None else dot_rows
    rows = dequant_rows_default(device.type, "int4", scheme.group, dot) if dequant_rows is None else dequant_rows
    model = load_model(folder, cfg, linear_weights=False, device=device, dtype=dtype)
    with _Tensors(folder) as tensors:
        for name, module, sources in linear_sources(model):
            parent, _, child = name.rpartition(".")
            packed = [f"{s}.qweight" in tensors for s in sources]
            if not any(packed):
                module.weight_t = torch.nn.Parameter(_float_weight(model, tensors, sources).t().to(
                    device, dtype).contiguous(), requires_grad=False)
                continue
            if not all(packed):
                raise ValueError(f"{folder}: {', '.join(sources)} are computed as one layer, and only some of "
                                 f"them are quantized")
            k, n = module.weight_t.shape
            parts = [unpack(scheme, *_layer(folder, tensors, s, scheme, k)) for s in sources]
            int4 = {key: torch.cat([p[key] for p in parts]) for key in ("w", "scales", "zeros")}
            if int4["w"].shape[0] != n:
                raise ValueError(f"{folder}: {', '.join(sources)} hold {int4['w'].shape[0]} outputs, "
                                 f"the model's config {n}")
            bias = None if module.bias is None else module.bias.data
            layer = QuantLinear("int4", int4, bias, scheme.group, device=device, dequant_rows=rows, dot_rows=dot)
            setattr(model.get_submodule(parent) if parent else model, child, layer)
    return model


def _layer(folder: Path, tensors: _Tensors, source: str, scheme: Scheme, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's qweight, qzeros and scales, their shapes checked against its k inputs; GPTQ's
    g_idx checked to be the plain k // group the int4 kernels compute."""
    if k % scheme.group:
        raise ValueError(f"{folder}: {source} has {k} inputs, which {scheme.method} groups of {scheme.group} "
                         f"do not divide")
    qweight, qzeros, scales = (tensors[f"{source}.{part}"] for part in ("qweight", "qzeros", "scales"))
    n, groups = scales.shape[1], k // scheme.group
    want = {"qweight": (k, n // 8) if scheme.method == "awq" else (k // 8, n), "qzeros": (groups, n // 8),
            "scales": (groups, n)}
    for part, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if tuple(t.shape) != want[part] or n % 8:
            raise ValueError(f"{folder}: {source}.{part} has shape {tuple(t.shape)}, expected {want[part]} for "
                             f"{k} inputs in {scheme.method} groups of {scheme.group}")
    if scheme.method == "gptq":
        g_idx = tensors.get(f"{source}.g_idx")
        if (g_idx is None and scheme.desc_act) or (
                g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // scheme.group)):
            raise ValueError(f"{folder}: {source} was quantized in activation order (quantization_config "
                             f"desc_act = true, its g_idx not k // group_size); the int4 kernels take each "
                             f"group's inputs in order: quantize with desc_act false (or static_groups)")
    return qweight, qzeros, scales


def _float_weight(model: CausalLM, tensors: _Tensors, sources: list[str]) -> torch.Tensor:
    """A Linear the checkpoint keeps in float: its weight [N, K], a tied head the embedding's."""
    if sources == ["lm_head"] and model.cfg.tie_embeddings:
        return model.embed_tokens.weight
    return torch.cat([tensors[f"{s}.weight"] for s in sources])


class _Tensors:
    """The folder's tensors by name across its safetensors shards, read one at a time."""

    def __init__(self, folder: Path):
        self._stack = ExitStack()
        self._files = {}
        for file in sorted(folder.glob("*.safetensors")):
            f = self._stack.enter_context(safe_open(file, framework="pt"))
            self._files |= dict.fromkeys(f.keys(), f)

    def __enter__(self) -> _Tensors:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[name].get_tensor(name)

    def get(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self else None
