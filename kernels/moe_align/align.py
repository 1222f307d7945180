"""Triton MoE layout: the routed assignments sorted by expert in four small launches.

The torch layout (kernels/ref/moe_align.py: a stable argsort, its inverse, a histogram, a cumsum,
then the row tiles' searchsorted and arithmetic) is ~30 launches of a few microseconds each per
MoE layer; a decode step of a 40-layer MoE paid ~1,200 of them. Here, a counting sort:
1. `_count_kernel`: each assignment takes its rank within its expert by an atomic add on the
   expert's count (the order among one expert's rows is arbitrary: each row of a grouped GEMM is
   computed from its own token alone, and the combine sums each token's k rows in slot order,
   so the outputs do not depend on it);
2. `_scan_kernel` (one program): the counts' running sum → ends, starts, and each expert's tiles
   (of the down kernel's row tile too, where it differs);
3. `_tiles_kernel` (once per table): each row tile's expert (the number of experts whose tiles
   end at or before it), its first row and its expert's end;
4. `_scatter_kernel`: row = start of its expert + its rank → token_of[row], slot[assignment].
Every output starts as a valid layout (every row expert 0's, ids zero): the engine's precompile
trace skips Triton launches, and the torch ops after them must still index with valid ids. Reference: kernels/ref/moe_align.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels.moe_fp8.tiles import ExpertTiles, tile_capacity
from batchinfer.kernels.ref.moe_align import ExpertLayout

BLOCK = 1024  # assignments a program of the count and scatter kernels
BLOCK_TILES = 64  # row tiles a program of the tiles kernel


@triton.jit
def _count_kernel(experts_ptr, counts_ptr, rank_ptr, M, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M
    expert = tl.load(experts_ptr + i, mask=ok, other=0)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=ok)  # the count before: this row's rank in its expert
    tl.store(rank_ptr + i, rank, mask=ok)


@triton.jit
def _scan_kernel(counts_ptr, starts_ptr, ends_ptr, tile_ends_ptr, down_tile_ends_ptr, E, BLOCK_M: tl.constexpr,
                 DOWN_BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    counts = tl.load(counts_ptr + e, mask=ok, other=0)
    ends = tl.cumsum(counts, axis=0)
    tl.store(ends_ptr + e, ends, mask=ok)
    tl.store(starts_ptr + e, ends - counts, mask=ok)
    if BLOCK_M > 0:
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tl.store(tile_ends_ptr + e, tl.cumsum(tiles, axis=0), mask=ok)
    if DOWN_BLOCK_M > 0:
        down_tiles = (counts + DOWN_BLOCK_M - 1) // DOWN_BLOCK_M
        tl.store(down_tile_ends_ptr + e, tl.cumsum(down_tiles, axis=0), mask=ok)


@triton.jit
def _tiles_kernel(tile_ends_ptr, starts_ptr, ends_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, E, capacity,
                  BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    tile_ends = tl.load(tile_ends_ptr + e, mask=e_ok, other=2147483647)  # [BE]
    owner = tl.sum((tile_ends[None, :] <= t[:, None]).to(tl.int32), axis=1)  # [BT] in [0, E]; E: unused tile
    used = owner < E
    expert = tl.minimum(owner, E - 1)
    first_tile = tl.load(tile_ends_ptr + expert) - (tl.load(ends_ptr + expert) - tl.load(starts_ptr + expert)
                                                    + BLOCK_M - 1) // BLOCK_M
    start = tl.load(starts_ptr + expert) + BLOCK_M * (t - first_tile)
    end = tl.where(used, tl.load(ends_ptr + expert), start)
    ok = t < capacity
    tl.store(tile_expert_ptr + t, expert, mask=ok)
    tl.store(tile_start_ptr + t, start, mask=ok)
    tl.store(tile_end_ptr + t, end, mask=ok)


@triton.jit
def _scatter_kernel(experts_ptr, rank_ptr, starts_ptr, token_of_ptr, slot_ptr, M, K: tl.constexpr,
                    BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M
    expert = tl.load(experts_ptr + i, mask=ok, other=0)
    row = tl.load(starts_ptr + expert, mask=ok, other=0) + tl.load(rank_ptr + i, mask=ok, other=0)
    tl.store(token_of_ptr + row, (i // K).to(tl.int32), mask=ok)
    tl.store(slot_ptr + i, row.to(tl.int32), mask=ok)


def _output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, fill: int = 0) -> torch.Tensor:
    """An output the kernels write whole. Filled first with a valid layout (`fill`) for the
    precompile trace, which skips the launches while the torch ops after them run."""
    return torch.full(shape, fill, dtype=dtype, device=device)


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int = 0, down_block_m: int = 0) -> ExpertLayout:
    """experts [T, k] (ids in [0, E)) → `ExpertLayout` (see kernels/ref/moe_align.py); `block_m` > 0
    adds the row tiles of the grouped FP8 GEMM, and a `down_block_m` other than it its down
    kernel's (one launch more, not the reference's dozen torch ops). No host sync."""
    T, k = experts.shape
    M, E, device = T * k, num_experts, experts.device
    flat = experts.reshape(-1).contiguous()
    down_block_m = down_block_m if block_m and down_block_m not in (0, block_m) else 0
    capacity = tile_capacity(M, E, block_m) if block_m else 0
    down_capacity = tile_capacity(M, E, down_block_m) if down_block_m else 0
    counts = torch.zeros(E, dtype=torch.int32, device=device)  # the histogram starts at zero
    rank, starts, tile_ends, down_tile_ends = torch.empty(M + 3 * E, dtype=torch.int32, device=device).split(
        [M, E, E, E])
    # The outputs in two fills (each a launch): the ids and tiles zeroed, the ends at M.
    token_of, slot, *tables = _output((2 * M + 3 * capacity + 3 * down_capacity,), torch.int32, device).split(
        [M, M] + [capacity] * 3 + [down_capacity] * 3)
    ends = _output((E,), torch.int32, device, fill=M)  # skipped: every row expert 0's, as zero ids give
    block_e = triton.next_power_of_2(max(E, 1))
    if M > 0:
        _count_kernel[(triton.cdiv(M, BLOCK),)](flat, counts, rank, M, BLOCK=BLOCK)
        _scan_kernel[(1,)](counts, starts, ends, tile_ends, down_tile_ends, E, BLOCK_M=block_m,
                           DOWN_BLOCK_M=down_block_m, BLOCK_E=block_e)
        _scatter_kernel[(triton.cdiv(M, BLOCK),)](flat, rank, starts, token_of, slot, M, K=k, BLOCK=BLOCK)
    tiles = _tiles(tile_ends, starts, ends, tables[:3], block_m, capacity, block_e) if block_m else None
    down_tiles = (_tiles(down_tile_ends, starts, ends, tables[3:], down_block_m, down_capacity, block_e)
                  if down_block_m else None)
    return ExpertLayout(token_of, slot.view(T, k), ends, tiles, down_tiles)


def _tiles(tile_ends: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, table: list[torch.Tensor],
           block_m: int, capacity: int, block_e: int) -> ExpertTiles:
    """The row tiles of `block_m` rows into `table` (expert, start, end: [capacity] each)."""
    expert, start, end = table
    if capacity > 0:
        _tiles_kernel[(triton.cdiv(capacity, BLOCK_TILES),)](
            tile_ends, starts, ends, expert, start, end, ends.numel(), capacity,
            BLOCK_M=block_m, BLOCK_T=BLOCK_TILES, BLOCK_E=block_e)
    return ExpertTiles(expert, start, end, capacity)
