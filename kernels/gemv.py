"""A dense Linear over a few rows, plain PyTorch: the reference twin of gemv_triton.py.

y = x @ weight_t + bias, with the weight stored transposed as the engine's Linear holds it,
weight_t [K, N] (in, out). Products summed in float32 and the bias added before one rounding to
x's dtype, as the Triton kernel does.
"""
import torch


def gemv_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None,
                scales: torch.Tensor | None = None) -> torch.Tensor:
    """`scales` float32 [N]: weight_t is int8 or float8 e4m3, each output's column scaled by its own."""
    y = x.float() @ weight_t.float()
    if scales is not None:
        y *= scales
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
