"""Decode steps on the CPU as one compiled call (kernels/decoder_cpu.py), where CUDA replays a
graph: the same operators on the same tensors, without Python between them. It takes a step
whose every token is a decode and whose every projection would run the integer kernels (int8,
int4 or a GGUF's own blocks; or a float32 GEMM) at that many rows; any other step, and a model
with layers it does not know (Qwen3's q/k norms, torch's packed or `_int_mm` matmuls), run
CausalLM.forward."""
from __future__ import annotations

import torch

from engine.model import CausalLM, Linear, StepBatch
from engine.quantize import GGUFLinear, QuantLinear
from kernels import decoder_cpu, quant_matmul


class CPUStep:
    def __init__(self, decoder, model: CausalLM, rows: range):
        self.decoder, self.model, self.rows = decoder, model, rows
        self.steps = 0          # steps it ran (sluice_engine_cpu_steps_total)

    @classmethod
    def build(cls, model: CausalLM, kv_caches: list, cpu_kernels: bool) -> CPUStep | None:
        """None where this model or host cannot take it, or the engine runs without the
        compiled layer kernels (cpu_kernels)."""
        cfg = model.cfg
        if cfg.qk_norm or not cpu_kernels or not decoder_cpu.load():
            return None
        layers = list(model.layers)
        attn = layers[0].self_attn
        decoder = torch.classes.sluice.Decoder(attn.h, attn.kvh, attn.d, cfg.rms_norm_eps, attn.scale)
        lo, hi = 1, 1 << 62
        for layer in layers:
            a = layer.self_attn
            for proj in (a.qkv_proj, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if isinstance(proj, Linear):
                    decoder.add_proj(0, proj.weight_t, None, None, proj.bias, 0)
                    continue
                b = proj._buffers
                if isinstance(proj, GGUFLinear):
                    if proj.compiled is None:
                        return None
                    decoder.add_gguf_proj(proj.parts(), proj.ids, b["bias"], proj.steps)
                    continue
                if not isinstance(proj, QuantLinear) or proj.dot is None or proj.dot is quant_matmul.int8_int8_matmul:
                    return None
                if proj.mode == "int8":
                    scales = b["dot_scales" if proj.packed else "scales"]
                    decoder.add_proj(1, b["w"], scales, None, b["bias"], proj.block)
                else:
                    decoder.add_proj(2, b["w"], b["scales"], b["zero_scales"], b["bias"], proj.group)
                lo = max(lo, proj.dot_rows)
                hi = min(hi, proj.dequant_rows or hi)
            decoder.add_norm(layer.input_layernorm.weight)
            decoder.add_norm(layer.post_attention_layernorm.weight)
        decoder.add_norm(model.norm.weight)
        for k, v, k_scale, v_scale in kv_caches:
            decoder.add_cache(k, v, k_scale, v_scale)
        return cls(decoder, model, range(lo, hi))

    def takes(self, batch: StepBatch, tokens: int) -> bool:
        return batch.num_decodes == tokens and tokens in self.rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        self.steps += 1
        cos, sin = self.model.rotary(positions)
        return self.decoder.decode(self.model.embed_tokens(input_ids), cos, sin, batch.slot_mapping,
                                   batch.decode_block_tables, batch.decode_context_lens)
