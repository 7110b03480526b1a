"""Weight-only quantized matmuls, plain PyTorch: the reference twins of quant_matmul_triton.py.

Formats (engine/quantize.py produces them):
  int8: w int8 [N, K], scales float32 [N]; symmetric per output channel: w ~= q * scale.
  int4: w uint8 [N, K // 2], two values 0..15 per byte (low nibble = even k, high = odd k),
        scales and zeros float32 [N, K // group]; asymmetric per group: w ~= (q - zero) * scale.
Both compute x [M, K] @ w.T -> [M, N] in x's dtype.
"""
import torch


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # On the CPU about a million weights (4 MB in float32) dequantized at a time, so each slice
    # is still in cache when the matmul reads it (the path for many rows, engine/quantize.py); a
    # GPU has no such cache to fit and pays per launch instead, so it takes the whole weight.
    n, k = w.shape
    out = x.new_empty(x.shape[0], n)
    step = n if w.is_cuda else max(1, (1 << 20) // k)
    # The scale applies per output, after the sum: the weights convert exactly (int8 in bf16 or
    # float32), and a pass over them is saved.
    for r in range(0, n, step):
        out[:, r:r + step] = (x @ w[r:r + step].to(x.dtype).T) * scales[r:r + step].to(x.dtype)
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] as int8 per row (symmetric, rounded to 1/254 of the row's largest value)
    and the scales [M, 1]: llama.cpp's q8 activations."""
    x_scale = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    return (x / x_scale).round_().to(torch.int8), x_scale


def int8_sums(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xq int8 [M, K] times w int8 [N, K], summed in int32: [M, N]."""
    return torch._int_mm(xq, w.t())


def int8_int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, sums=int8_sums) -> torch.Tensor:
    """Integer dot products, as llama.cpp decodes: x quantized per row (`quantize_rows`), its
    products with the int8 weights w [N, K] summed in int32 (`sums`: torch's `_int_mm`, or the
    compiled AVX2 kernel of quant_matmul_cpu.py), then both scales applied. Not exact against
    int8_matmul: x loses bits."""
    xq, x_scale = quantize_rows(x)
    return sums(xq, w).to(x.dtype) * (x_scale * scales.to(x.dtype))


def int4_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    N = w.shape[0]
    q = torch.stack((w & 0xF, w >> 4), dim=-1).view(N, -1).float()   # [N, K], k in order
    deq = (q - zeros.repeat_interleave(group_size, 1)) * scales.repeat_interleave(group_size, 1)
    return x @ deq.to(x.dtype).T
