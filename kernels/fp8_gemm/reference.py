"""Plain-torch FP8 block quantization and the block-scaled GEMM's reference.

Weights: e4m3 values with one fp32 scale per `block` (128 × 128) tile, stored as Qwen's
`weight_scale_inv` (the factor that *multiplies* the FP8 values back: w ≈ fp8 · scale_inv);
the scale grid is [ceil(N/128), ceil(K/128)] (edge tiles are partial). Activations: one scale
per (token, 128-column group), amax / 448 — `activation_scheme: dynamic`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3fn value
GROUP = 128              # activation group / weight block edge
AMAX_FLOOR = 1e-10       # an all-zero group gets a tiny scale, not 0/0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_act_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], fp32 scales [M, ceil(K/group)]); x ≈ q · scale per group."""
    M, K = x.shape
    G = _cdiv(K, group)
    xp = F.pad(x.float(), (0, G * group - K)).view(M, G, group)
    amax = xp.abs().amax(-1).clamp_min(AMAX_FLOOR)  # [M, G]
    # A tensor divisor: CUDA torch turns division by a scalar into a product with its
    # (rounded) reciprocal, which the kernel's correctly rounded division would not match.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xp / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, G * group)[:, :K].contiguous(), scale


def block_quantize(w: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] → (e4m3 [..., N, K], fp32 scale_inv [..., ceil(N/bn), ceil(K/bk)])."""
    bn, bk = block
    *lead, N, K = w.shape
    Gn, Gk = _cdiv(N, bn), _cdiv(K, bk)
    wp = F.pad(w.float(), (0, Gk * bk - K, 0, Gn * bn - N)).reshape(*lead, Gn, bn, Gk, bk)
    amax = wp.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR)  # [..., Gn, Gk]
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (wp / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, Gn * bn, Gk * bk)[..., :N, :K].contiguous()
    return q, scale


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                     block: tuple[int, int] = (GROUP, GROUP)) -> torch.Tensor:
    """The inverse of `block_quantize`: fp8 [..., N, K] · scale_inv (per block) → dtype."""
    bn, bk = block
    *lead, N, K = q.shape
    if N % bn == 0 and K % bk == 0:  # whole blocks: broadcast the scales, no expanded copy of them
        blocks = q.reshape(*lead, N // bn, bn, K // bk, bk).float() * scale_inv.float()[..., :, None, :, None]
        return blocks.reshape(q.shape).to(dtype)
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
    return (q.float() * s).to(dtype)


def fp8_gemm_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (16/32-bit) · dequant(weight [N, K], scale_inv)ᵀ → [M, N] in out_dtype (x's by
    default): the activations quantized per token group as the kernel does, both operands
    dequantized, the product in fp32."""
    xq, xs = quantize_act_reference(x)
    x_deq = (xq.float().view(x.shape[0], -1) * xs.repeat_interleave(GROUP, dim=1)[:, :x.shape[1]])
    w_deq = block_dequantize(weight, scale_inv)
    return (x_deq @ w_deq.t()).to(out_dtype or x.dtype)
