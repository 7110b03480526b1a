"""Kernels the engine calls. Each has a plain-PyTorch reference twin; on CPU the reference
is what runs."""
from kernels.attention import paged_decode_attention, paged_prefill_attention, store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
