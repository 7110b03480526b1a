"""A decode step's decoder layers as one compiled call on the CPU: the CPU's counterpart of a
CUDA graph. At batch 1 the weights stream in tens of milliseconds, and Python between a
layer's dozen operators added 11-19% of a step (benchmarks/cpu_profile.py); here C++ calls
the same operators (layer_cpu.py's and quant_matmul_cpu.py's, through torch's dispatcher) in
the same order on the same tensors, so the result is the Python path's to the bit: its
reference twin is engine/model.py's CausalLM.forward (tests/test_cpu_step.py).

`Decoder` (torch.classes.sluice.Decoder, kernels/csrc/decoder.cpp) is built once per model from
its modules (engine/cpu_step.py): per layer two norms and four projections (q|k|v, o, gate|up,
down), each float32 (`Linear`'s [in, out] weight), int8 or int4 on the integer kernels, with a
bias or not; then the final norm and the KV cache of each layer, float32 or int8 with scales.
"""
from __future__ import annotations

import functools

from kernels import layer_cpu, quant_matmul_cpu
from kernels.cpu_build import CSRC, build


@functools.cache
def load() -> bool:
    """Whether torch.classes.sluice.Decoder can run here: it calls the compiled layer and
    integer kernels, so those must build too."""
    return (layer_cpu.load() is not None and quant_matmul_cpu.load() is not None
            and build("sluice_decoder", [CSRC / "decoder.cpp"], "decode steps call a layer's operators from Python"))
