"""Kernels the engine calls. Each has a plain-PyTorch reference twin with the same signature;
these dispatchers run the Triton kernel when the first argument is a CUDA tensor and Triton is
installed (a twin that fails to launch falls back to the reference, once, logged), the compiled
CPU kernel of layer_cpu.py for a float32 CPU tensor where the running engine has them on
(`with_cpu_ops`), and the reference otherwise. Triton is imported only on the first CUDA
call, so `import kernels` and everything on CPU work without it."""
import functools
import importlib
import importlib.util
import logging
from contextvars import ContextVar
from typing import Callable

import torch

from kernels import activation, attention, gemv, gguf_quant, layer_cpu, norm_rope, quant_matmul

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Kernels whose Triton twin failed to launch here (say, more shared memory than the GPU has):
# they run their reference from then on. Read by the engine's metrics.
FALLBACKS: set[str] = set()
log = logging.getLogger(__name__)
# layer_cpu's operators by name for the model running now, else None. Each engine's runner holds
# its own (`cpu_ops`) and sets them around its model calls (`with_cpu_ops`), so two engines in one
# process keep their own choice. Each operator resolved once (torch.ops' attribute lookup costs
# microseconds a call).
_cpu_ops: ContextVar[dict[str, Callable] | None] = ContextVar("sluice_cpu_ops", default=None)


def cpu_ops(on: bool) -> dict[str, Callable] | None:
    """layer_cpu's compiled kernels for a runner to hold (building them on the first call,
    about a minute); None when off or when they cannot be built here."""
    ops = layer_cpu.load() if on else None
    return None if ops is None else {name: getattr(ops, name).default for name in layer_cpu.KERNELS}


class with_cpu_ops:
    """Within the block, in this thread, float32 CPU tensors run `ops` (cpu_ops' value; None:
    the references). A class, not a generator: every step enters one."""

    def __init__(self, ops: dict[str, Callable] | None):
        self.ops = ops

    def __enter__(self) -> None:
        self.token = _cpu_ops.set(self.ops)

    def __exit__(self, *exc) -> None:
        _cpu_ops.reset(self.token)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON


@functools.cache
def _launch_errors() -> tuple[type[Exception], ...]:
    from triton.runtime.errors import OutOfResources
    return (OutOfResources,)


def _dispatch(reference: Callable) -> Callable:
    """The reference, or its Triton twin of the same name in `<module>_triton` on CUDA, or its
    compiled CPU twin; a Triton twin that cannot launch is logged once and replaced by the
    reference, so no request fails for it."""
    name = reference.__name__
    compiled = name in layer_cpu.KERNELS

    @functools.cache
    def twin() -> Callable:
        return getattr(importlib.import_module(reference.__module__ + "_triton"), name)

    @functools.wraps(reference)
    def call(*args, **kwargs):
        x = args[0]
        if name not in FALLBACKS and _use_triton(x):
            try:
                return twin()(*args, **kwargs)
            except _launch_errors() as e:
                FALLBACKS.add(name)
                log.warning("kernel %s cannot launch on %s (%s); its reference twin runs from now on",
                            name, x.device, e)
        elif compiled and x.is_cpu and x.dtype == torch.float32 and (ops := _cpu_ops.get()) is not None:
            return ops[name](*args, **kwargs)
        return reference(*args, **kwargs)
    return call


paged_decode_attention = _dispatch(attention.paged_decode_attention)
paged_prefill_attention = _dispatch(attention.paged_prefill_attention)
int8_matmul = _dispatch(quant_matmul.int8_matmul)
int4_matmul = _dispatch(quant_matmul.int4_matmul)
gguf_matmul = _dispatch(gguf_quant.gguf_matmul)
gemv_linear = _dispatch(gemv.gemv_linear)
quantize_fp8 = _dispatch(quant_matmul.quantize_fp8)
add_rms_norm = _dispatch(norm_rope.add_rms_norm)
rotary_store_kv = _dispatch(norm_rope.rotary_store_kv)
silu_and_mul = _dispatch(activation.silu_and_mul)
rotate_keys = norm_rope.rotate_keys     # tensor operations on every device: nothing to dispatch

__all__ = ["paged_decode_attention", "paged_prefill_attention", "int8_matmul", "int4_matmul", "gguf_matmul",
           "gemv_linear", "quantize_fp8", "add_rms_norm", "rotary_store_kv", "silu_and_mul"]
