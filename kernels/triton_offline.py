"""Triton kernels compiled for a GPU on a machine without one (Triton ships its own ptxas).

`Record` stands in for a kernel, so that a wrapper called on CPU tensors records the launch it
would make (its arguments, tiles and constexprs) instead of running it; `compile_launch` compiles
that launch for a compute capability as Triton's launcher specializes it. The tests use it to
check that every kernel compiles and fits in shared memory; benchmarks/gguf_sass.py to count
the machine code's instructions.
"""
from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTEE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64",
           torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}


class Record:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` appends (kernel, args,
    kwargs) to `launches`."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def compile_launch(kernel, args: tuple, kwargs: dict, capability: int):
    """A recorded launch compiled for sm_`capability`, 16-byte aligned pointers and integers
    divisible by 16 marked so, as the launcher marks them -> Triton's compiled kernel."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        v = values[name]
        if i in kernel.constexprs or v is None:
            signature[name], constants[name] = "constexpr", v
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            tensor = isinstance(v, torch.Tensor)
            signature[name] = "*" + POINTEE[v.dtype] if tensor else "i32"
            if (v.data_ptr() if tensor else v) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", capability, 32),
                          options=options)
