"""Reference MoE routing (plain torch, fp32): what `kernels/moe_route/` computes.

Transformers' Qwen3-Next / Qwen3.5-MoE router exactly: softmax over all experts in fp32, the
top-k, and (`renormalize`) the k weights divided by their sum.
"""
from __future__ import annotations

import torch


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 → (experts [T, k] int64, weights [T, k] fp32), weights descending."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights
