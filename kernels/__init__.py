"""Kernels the engine calls. Each has a plain-PyTorch reference twin with the same signature;
these dispatchers run the Triton kernel when the first argument is a CUDA tensor and Triton is
installed, and the reference otherwise (a twin that fails to launch falls back to the
reference, once, logged). Triton is imported only on the first CUDA call, so
`import kernels` and everything on CPU work without it."""
import functools
import importlib
import importlib.util
import logging
from typing import Callable

import torch

from kernels import activation, attention, norm_rope, quant_matmul

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Kernels whose Triton twin failed to launch here (say, more shared memory than the GPU has):
# they run their reference from then on. Read by the engine's metrics.
FALLBACKS: set[str] = set()
log = logging.getLogger(__name__)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON


@functools.cache
def _launch_errors() -> tuple[type[Exception], ...]:
    from triton.runtime.errors import OutOfResources
    return (OutOfResources,)


def _dispatch(reference: Callable) -> Callable:
    """The reference, or its Triton twin of the same name in `<module>_triton`; a twin that
    cannot launch is logged once and replaced by the reference, so no request fails for it."""
    name = reference.__name__

    @functools.cache
    def twin() -> Callable:
        return getattr(importlib.import_module(reference.__module__ + "_triton"), name)

    @functools.wraps(reference)
    def call(*args, **kwargs):
        if name in FALLBACKS or not _use_triton(args[0]):
            return reference(*args, **kwargs)
        try:
            return twin()(*args, **kwargs)
        except _launch_errors() as e:
            FALLBACKS.add(name)
            log.warning("kernel %s cannot launch on %s (%s); its reference twin runs from now on",
                        name, args[0].device, e)
            return reference(*args, **kwargs)
    return call


paged_decode_attention = _dispatch(attention.paged_decode_attention)
paged_prefill_attention = _dispatch(attention.paged_prefill_attention)
int8_matmul = _dispatch(quant_matmul.int8_matmul)
int4_matmul = _dispatch(quant_matmul.int4_matmul)
add_rms_norm = _dispatch(norm_rope.add_rms_norm)
rotary_store_kv = _dispatch(norm_rope.rotary_store_kv)
silu_and_mul = _dispatch(activation.silu_and_mul)

__all__ = ["paged_decode_attention", "paged_prefill_attention", "int8_matmul", "int4_matmul",
           "add_rms_norm", "rotary_store_kv", "silu_and_mul"]
