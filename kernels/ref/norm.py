"""Reference RMSNorms of the Qwen3.5 / Qwen3-Next family (plain torch, fp32 math).

Two flavours, because the family uses both: the residual-stream norm scales by `(1 + weight)`
(its weights are stored zero-centred), while the GDN output norm scales by the plain weight and
multiplies by `silu(z)`, the per-token output gate. `add_rms_norm` is the residual-stream norm
preceded by the residual add it always follows in a pre-norm decoder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x) · (1 + weight)` over the last dim; output in x.dtype."""
    return (_normalise(x, eps) * (1.0 + weight.float())).to(x.dtype)  # [..., N]


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x) · weight · silu(z)` over the last dim; output in x.dtype."""
    gate = F.silu(z.float())
    return (_normalise(x, eps) * weight.float() * gate).to(x.dtype)  # [..., N]


def add_rms_norm(x: torch.Tensor, residual_delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, normed): `sum = x + residual_delta` rounded to x.dtype, `normed = rms_norm(sum)`.

    The norm reads the rounded sum, exactly as an unfused `x = x + delta; rms_norm(x)` does,
    so the residual stream and its normed copy stay consistent with each other.
    """
    summed = (x + residual_delta).to(x.dtype)  # [..., N]
    return summed, rms_norm(summed, weight, eps)
