"""Kernels the engine calls. Each has a plain-PyTorch reference twin with the same signature;
these dispatchers run the Triton kernel when the first argument is a CUDA tensor and Triton is
installed, and the reference otherwise. Triton is imported only on the first CUDA call, so
`import kernels` and everything on CPU work without it."""
import functools
import importlib
import importlib.util
from typing import Callable

import torch

from kernels import attention, norm_rope, quant_matmul

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and HAS_TRITON


def _dispatch(reference: Callable) -> Callable:
    """The reference, or its Triton twin of the same name in `<module>_triton`."""
    @functools.cache
    def twin() -> Callable:
        return getattr(importlib.import_module(reference.__module__ + "_triton"), reference.__name__)

    @functools.wraps(reference)
    def call(*args, **kwargs):
        return (twin() if _use_triton(args[0]) else reference)(*args, **kwargs)
    return call


store_kv = _dispatch(attention.store_kv)
paged_decode_attention = _dispatch(attention.paged_decode_attention)
paged_prefill_attention = _dispatch(attention.paged_prefill_attention)
int8_matmul = _dispatch(quant_matmul.int8_matmul)
int4_matmul = _dispatch(quant_matmul.int4_matmul)
add_rms_norm = _dispatch(norm_rope.add_rms_norm)
apply_rotary = _dispatch(norm_rope.apply_rotary)

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "int8_matmul", "int4_matmul",
           "add_rms_norm", "apply_rotary"]
