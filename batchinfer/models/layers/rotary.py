"""Partial rotary position embedding (the rotate-half convention of transformers' Qwen models):
the per-token angles. The rotation itself is the op `rms_norm_rope` (kernels/ref/rope.py),
fused with the q/k norm that precedes it.

Only the first `rotary_dim` channels of each head rotate; the rest pass through. Channel i of
the rotary part pairs with channel i + rotary_dim/2. Angles are computed in fp32 from the
absolute positions of the step, so packed sequences need no per-sequence bookkeeping.
"""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, device: torch.device | str):
        super().__init__()
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (theta ** exponents), persistent=False)  # [rot/2]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin of every position's angles. positions [T] → ([T, rot/2], [T, rot/2])."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()
