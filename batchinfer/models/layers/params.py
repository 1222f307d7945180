"""Parameter allocation shared by the layers.

Weights are allocated uninitialised directly on the target device and dtype; the checkpoint
loader or a preset's random init then fills every one of them (the loader checks coverage).
Inference only, so no parameter tracks gradients.
"""
from __future__ import annotations

import torch
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
