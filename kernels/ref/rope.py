"""Reference partial rotary embedding (the rotate-half convention of transformers' Qwen models),
and the q/k per-head RMSNorm + rotary pair the attention layers apply (plain torch, fp32 math).

Only the first `rotary_dim` channels of each head rotate; channel i of that part pairs with
channel i + rotary_dim/2; the rest pass through.
"""
from __future__ import annotations

import torch

from batchinfer.kernels.ref.norm import rms_norm


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate x [T, heads, d] by per-token angles (cos, sin [T, rotary_dim/2], fp32) in fp32;
    output in x.dtype."""
    half = rotary_dim // 2
    x1 = x[..., :half].float()  # [T, heads, rot/2]
    x2 = x[..., half:rotary_dim].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  rotary_dim: int) -> torch.Tensor:
    """`rotate_half(rms_norm(x, weight, eps))` per head: x [T, heads, d] (any strides), weight [d]
    (scaled by 1 + weight), cos / sin [T, rotary_dim/2] fp32 → [T, heads, d] in x.dtype. The
    normed values are rounded to x.dtype before they rotate, as the two ops apart do."""
    return rotate_half(rms_norm(x, weight, eps), cos, sin, rotary_dim)
