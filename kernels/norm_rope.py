"""RMSNorm with the residual add, and rotary embedding, plain PyTorch: the reference twins of
norm_rope_triton.py."""
import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) over the last dim; residual None adds nothing.

    As in Hugging Face: the sum is taken in x's dtype, the norm in fp32, and the normed value is
    cast back to x's dtype before the weight multiplies it.
    """
    h = x if residual is None else x + residual
    normed = F.rms_norm(h.float(), h.shape[-1:], eps=eps)   # one fused op; equal to HF's pow/mean/rsqrt
    return (weight * normed.to(h.dtype)).to(h.dtype), h


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, head_dim / 2] (or [T, 1, head_dim / 2]).

    Hugging Face's non-interleaved layout: the rotated pairs are (x[i], x[i + head_dim / 2]).
    """
    cos, sin = cos.reshape(x.shape[0], 1, -1), sin.reshape(x.shape[0], 1, -1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
