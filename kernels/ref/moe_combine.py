"""Reference MoE combine (plain torch, fp32 math): what `kernels/moe_combine/` computes.

A token's output is Σ_j weight[t, j] · y[slot[t, j]] over its k routed assignments, plus its
shared expert times sigmoid(its gate logit), summed in fp32 and rounded once. `y` holds the expert outputs of the
assignments sorted by expert (`SparseMoE`'s layout); `slot[t, j]` is where token t's j-th
assignment landed in that order. The sum runs as the MoE layer always summed it, one
`index_add_` over the sorted rows, so the CPU path is bit-identical to before (and to
transformers' per-expert loop order in fp32).
"""
from __future__ import annotations

import torch


def moe_combine(y: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor,
                shared_gate_logits: torch.Tensor) -> torch.Tensor:
    """y [T·k, H]; slot [T, k] int; weights [T, k] fp32; shared [T, H]; shared_gate_logits [T, 1]
    (any float dtype; the gate is their sigmoid in fp32) → [T, H] in shared.dtype."""
    T, k = slot.shape
    flat = slot.reshape(-1).long()  # [T·k] sorted position of each (token, j)
    token_of = torch.empty_like(flat)
    token_of[flat] = torch.arange(T, device=slot.device).repeat_interleave(k)  # [T·k] token of each sorted row
    weight_of = torch.empty(T * k, dtype=torch.float32, device=slot.device)
    weight_of[flat] = weights.reshape(-1).float()  # [T·k] weight of each sorted row
    routed = torch.zeros(T, y.shape[1], dtype=torch.float32, device=y.device)
    routed.index_add_(0, token_of, y.float() * weight_of[:, None])  # [T, H]
    return (routed + shared.float() * torch.sigmoid(shared_gate_logits.float())).to(shared.dtype)
