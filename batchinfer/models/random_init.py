"""Deterministic random weights that keep activations finite through deep stacks.

Used by the presets (our parameter names) and the checkpoint writer (Hugging Face names), so
the rules key on name fragments common to both. Matrices get std 1/sqrt(fan_in); the
projections that write into the residual stream are further scaled by 1/sqrt(2·layers) so
the stream's variance stays O(1) after every layer. 1-D weights are the family's
zero-centred (1 + w) norms, except the GDN output norm (plain weight, centred on 1).
"""
from __future__ import annotations

import math

import torch

# Projections whose output is added to the residual stream.
_RESIDUAL_WRITERS = ("o_proj", "out_proj", "down")


@torch.no_grad()
def init_random_(tensor: torch.Tensor, name: str, num_layers: int, generator: torch.Generator) -> None:
    """Fill `tensor` (any device/dtype) in place according to what `name` says it is."""
    if name.endswith("A_log"):
        # Per-head decay rates exp(A_log) in [1, 16], as transformers initialises them.
        tensor.uniform_(1.0, 16.0, generator=generator).log_()
    elif name.endswith("dt_bias"):
        # Mamba / fla convention: step size dt log-uniform in [1e-3, 0.1], stored as its inverse
        # softplus. Gives the long per-token memory of trained models; a short-memory init makes
        # the GDN output hinge on single near-zero dot products that bf16 cannot resolve.
        log_dt = tensor.new_empty(tensor.shape, dtype=torch.float32).uniform_(
            math.log(1e-3), math.log(0.1), generator=generator)
        dt = log_dt.exp()
        tensor.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif name.endswith(("linear_attn.norm.weight", "norm_weight")):
        tensor.normal_(1.0, 0.1, generator=generator)  # plain-weight gated norm
    elif tensor.dim() == 1:
        tensor.normal_(0.0, 0.1, generator=generator)  # (1 + w) norms
    elif "embed" in name:
        tensor.normal_(0.0, 1.0, generator=generator)
    else:
        fan_in = tensor.shape[-1]  # last dim is the input dim of every weight here (conv: its taps)
        std = 1.0 / math.sqrt(fan_in)
        if any(part in name for part in _RESIDUAL_WRITERS):
            std /= math.sqrt(2 * num_layers)
        tensor.normal_(0.0, std, generator=generator)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator
