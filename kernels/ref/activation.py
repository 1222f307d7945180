"""Reference SwiGLU activation (plain torch, fp32 math).

The dense MLP and the MoE experts project x once to a fused `gate | up` row; the activation
is `silu(gate) · up`. Computing it in fp32 and rounding once is exact for fp32 inputs (the
`.float()` calls are no-ops), so the CPU path is bit-identical to `F.silu(gate) * up`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate_up[..., :I]) · gate_up[..., I:]` -> [..., I], in gate_up.dtype."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)  # [..., I]
