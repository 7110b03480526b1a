"""Weight-only quantized matmuls, plain PyTorch: the reference twins of quant_matmul_triton.py
and quant_matmul_cpu.py.

Formats (engine/quantize.py produces them):
  int8: w int8 [N, K], scales float32 [N]; symmetric per output channel: w ~= q * scale.
  int4: w uint8 [N, K // 2], two values 0..15 per byte (low nibble = even k, high = odd k),
        scales and zeros float32 [N, K // group]; asymmetric per group: w ~= (q - zero) * scale.
  fp8:  w float8 e4m3 [N, K], scales float32 [N]; per output channel, the largest weight of a
        row at e4m3's largest value (448): w ~= q * scale. Its activations are rounded the same
        way per row (token), so both operands of the matmul are e4m3.
Each computes x [M, K] @ w.T -> [M, N] in x's dtype.
"""
import torch


def _dense(x: torch.Tensor, n: int, k: int, weights) -> torch.Tensor:
    """x @ w.T over w's rows dequantized a slice at a time (`weights(r0, r1)`: rows r0..r1 in
    x's dtype). On the CPU about a million weights (4 MB in float32) at a time, so each slice is
    still in cache when the matmul reads it (the path for many rows, engine/quantize.py); a GPU
    has no such cache to fit and pays per launch instead, so it takes the whole weight."""
    out = x.new_empty(x.shape[0], n)
    step = n if x.is_cuda else max(1, (1 << 20) // k)
    for r in range(0, n, step):
        out[:, r:r + step] = x @ weights(r, min(n, r + step)).T
    return out


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # The scale applies per output, after the sum: the weights convert exactly (int8 in bf16 or
    # float32), and a pass over them is saved.
    n, k = w.shape
    out = _dense(x, n, k, lambda r0, r1: w[r0:r1].to(x.dtype))
    return out.mul_(scales.to(x.dtype))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """w uint8 [N, K // 2] -> its values 0..15 [N, K], k in order."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1)


def act_block(k: int) -> int:
    """How many activations share an int8 scale on the compiled integer kernels (int8 weights;
    int4 ones take their group): 128, or 64 or 32 where k takes no 128; 0 where k takes no 32.
    One scale per row lets an outlier (a few of Qwen2.5's intermediate activations stand far
    above the rest) round the rest of its row away: on SQuAD text a whole-row scale gave the down
    projections 3.5x (0.5B) and 4.5x (1.5B) the error of 128-value blocks
    (benchmarks/act_quant_error.py)."""
    return next((b for b in (128, 64, 32) if k % b == 0), 0)


def quantize_rows(x: torch.Tensor, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] as int8, symmetric per block of `block` values of each row (0: the whole
    row), rounded to 1/254 of the block's largest value, and the scales [M, K // block] ([M, 1]):
    llama.cpp's q8 activations."""
    m, k = x.shape
    blocks = x.view(m, -1, block or k)
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    return (blocks / scale).round_().to(torch.int8).view(m, k), scale.view(m, -1)


def _block_sums(xq: torch.Tensor, q: torch.Tensor, block: int) -> torch.Tensor:
    """[M, N, K // block]: each block's integer sum of xq [M, K] times q [N, K] (exact in float64)."""
    (m, k), n = xq.shape, q.shape[0]
    return torch.einsum("mgk,ngk->mng", xq.view(m, k // block, block).double(), q.view(n, k // block, block).double())


def int8_int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Integer dot products, as llama.cpp decodes: x quantized to int8 (`quantize_rows`), its
    products with the int8 weights w [N, K] summed in int32, then the scales applied. `block` 0:
    one scale per row, so one int32 GEMM (torch's `_int_mm`) serves; else per block of x, the
    twin of quant_matmul_cpu's `int8_linear` (which sums the blocks in float32, in another
    order). Not exact against int8_matmul: x loses bits."""
    xq, x_scale = quantize_rows(x, block)
    if not block:
        return torch._int_mm(xq, w.t()).to(x.dtype) * (x_scale * scales.to(x.dtype))
    y = (_block_sums(xq, w, block) * x_scale.double()[:, None, :]).sum(-1)
    return (y * scales.double()).to(x.dtype)


def int4_int8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """Integer dot products against int4 weights (llama.cpp's q4 x q8): x quantized per group of
    the weights, per group the integer sum of its products with the weights' 0..15 values times
    the group's scale, less zero * scale times the group's sum of x, each times x's scale for the
    group. The twin of quant_matmul_cpu's `int4_linear` (which sums the groups in float32, in
    another order)."""
    xq, x_scale = quantize_rows(x, group_size)
    m, k = x.shape
    sums = _block_sums(xq, unpack_int4(w), group_size)
    x_sums = xq.view(m, k // group_size, group_size).double().sum(-1)[:, None]
    y = (sums * scales.double() - (zeros * scales).double() * x_sums) * x_scale.double()[:, None, :]
    return y.sum(-1).to(x.dtype)


def dequantize_int4(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """int4 weights [N, K // 2] in float32 [N, K]."""
    q = unpack_int4(w).float()
    return (q - zeros.repeat_interleave(group_size, 1)) * scales.repeat_interleave(group_size, 1)


def int4_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    def weights(r0: int, r1: int) -> torch.Tensor:
        return dequantize_int4(w[r0:r1], scales[r0:r1], zeros[r0:r1], group_size).to(x.dtype)
    return _dense(x, w.shape[0], 2 * w.shape[1], weights)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0         # e4m3fn's largest finite value


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] as float8 e4m3, scaled per row so that its largest magnitude lands on 448,
    and the scales float32 [M, 1] (x ~= q * scale). A row of zeros takes scale 1, not 0 / 0. The
    same ops on every device, so a GPU rounds activations as this twin does: the scale multiplies
    by 1 / 448, as CUDA's torch does for any division by a Python number (a true division on the
    CPU would differ from it in the last bit)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax * (1 / FP8_MAX), torch.ones_like(amax))
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 per row (`quantize_fp8`), times the e4m3 weights w [N, K], summed in
    float32, then each row's and each output's scale: what torch._scaled_mm computes with
    row-wise scales on FP8 tensor cores, emulated exactly where there are none. A product of two
    e4m3 values (4 significant bits each) is exact in float32; only the sums round."""
    xq, x_scale = quantize_fp8(x)
    n, k = w.shape
    out = _dense(xq.float(), n, k, lambda r0, r1: w[r0:r1].float())
    return (out * x_scale * scales).to(x.dtype)
