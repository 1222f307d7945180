"""Reference MoE layout (plain torch): the routed assignments sorted by expert, as `SparseMoE` ran
it before the op existed.

Assignment i = t·k + j is token t's j-th expert. Sorted stably by expert (argsort), row r of the
sorted order reads token `token_of[r]`; `slot[t, j]` is where assignment (t, j) landed; expert e
owns rows [ends[e-1], ends[e]); with `block_m` the row tiles of the grouped FP8 GEMM
(`kernels/moe_fp8/tiles.py`), and with `down_block_m` its down kernel's own where they differ.
Every output has a fixed size (no host sync: decode steps stay graph-capturable).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from batchinfer.kernels.moe_fp8.tiles import ExpertTiles, expert_tiles


@dataclass(frozen=True)
class ExpertLayout:
    token_of: torch.Tensor  # [T·k] int32: the token of each sorted row
    slot: torch.Tensor      # [T, k] int32: the sorted row of each assignment
    ends: torch.Tensor      # [E] int32: one past each expert's last row
    tiles: Optional[ExpertTiles] = None  # row tiles of `block_m` rows, when asked
    down_tiles: Optional[ExpertTiles] = None  # row tiles of `down_block_m` rows, when asked and != block_m


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int = 0, down_block_m: int = 0) -> ExpertLayout:
    """experts [T, k] (ids in [0, E)) → the layout; `block_m` > 0 adds the row tiles, and a
    `down_block_m` other than it a second table for the down kernel."""
    T, k = experts.shape
    flat = experts.reshape(-1)  # [T·k]
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    slot = torch.empty_like(order)
    slot[order] = torch.arange(T * k, device=experts.device)  # [T·k] the inverse permutation
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # [E]
    ends = counts.cumsum(0).to(torch.int32)
    tiles = expert_tiles(ends, T * k, block_m) if block_m else None
    down_tiles = expert_tiles(ends, T * k, down_block_m) if block_m and down_block_m not in (0, block_m) else None
    return ExpertLayout((order // k).to(torch.int32), slot.view(T, k).to(torch.int32), ends, tiles, down_tiles)
