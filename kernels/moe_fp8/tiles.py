"""The row tiles of a grouped expert GEMM: each tile is up to `block_m` rows of one expert.

Sized from shapes alone (no device-to-host sync, so decode steps stay graph-capturable):
Σ_e ceil(rows_e / block_m) ≤ M // block_m + min(E, M), so that many tiles always suffice; the
unused tail tiles have `end == start` and their programs exit at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertTiles:
    expert: torch.Tensor  # [capacity] int32: the tile's expert (clamped to E-1 for unused tiles)
    start: torch.Tensor  # [capacity] int32: first sorted row of the tile
    end: torch.Tensor  # [capacity] int32: one past the expert's last row (== start: unused)
    capacity: int


def tile_capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    return num_rows // block_m + min(num_experts, num_rows)


def expert_tiles(ends: torch.Tensor, num_rows: int, block_m: int) -> ExpertTiles:
    """Tiles over rows sorted by expert, expert e owning rows [ends[e-1], ends[e])."""
    ends = ends.to(torch.int32)
    E = ends.numel()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    per_expert = (ends - starts + block_m - 1) // block_m  # [E]
    tile_ends = per_expert.cumsum(0).to(torch.int32)  # end of each expert's tiles
    capacity = tile_capacity(num_rows, E, block_m)
    ids = torch.arange(capacity, dtype=torch.int32, device=ends.device)
    owner = torch.searchsorted(tile_ends, ids, right=True)  # [capacity] in [0, E]; E = unused
    used = owner < E
    expert = owner.clamp(max=E - 1)
    start = starts[expert] + block_m * (ids - (tile_ends[expert] - per_expert[expert]))
    end = torch.where(used, ends[expert], start)
    return ExpertTiles(expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32), capacity)
