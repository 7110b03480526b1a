"""The MLP's gated activation, plain PyTorch: the reference twin of activation_triton.py."""
import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I], the fused gate|up projection -> silu(gate) * up [..., I], in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
