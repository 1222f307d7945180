"""The ReplaySSM launch knobs (`StepLaunch`, whose field defaults are the launch the op runs) and
the pool checks every launcher shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class StepLaunch:
    """Launch knobs of the decode step kernel and its flush launch (benchmarks sweep these).

    The step holds what it loads in registers; with d_k chunks and num_stages > 1, Triton
    issues the chunks as cp.async into shared memory up front, so more bytes are in flight
    per register. The field defaults are the H200 sweeps' best (CUDA-graph timing, `python -m
    benchmarks.bench_replay_attn --replay`), what the op runs: 64-column tiles over 2 warps, d_k
    in 64-row chunks 3 deep, the ring-key dots once per key head in their own launch, only the
    live ring entries loaded, and the flush a persistent launch (8 programs per SM) over the full
    rings only, in (row, value head, d_v block) work items: more folds in flight when few rings
    are full, the common case under continuous admission. docs/BENCHMARKS.md: "ReplaySSM:
    tensor-core dots and many small programs", "ReplaySSM: the flush launch and live ring loads".
    """
    block_v: int = 64
    block_k: int = 64
    num_warps: int = 2
    num_stages: int = 3
    tensor_cores: bool = True  # d_k dots as mma's; False: broadcast-multiply + tl.sum (FMA)
    key_dots_in_flush: bool = True  # rk·k, rk·q once per (seq, key head) in the flush launch
    flush_block_v: int = 128  # the flush folds one [d_k, flush_block_v] tile per program,
    flush_block_k: int = 32  # in chunks of this many d_k rows
    flush_warps: int = 4
    # One flush program per (sequence, key head), folding its GROUP value heads × d_v blocks in
    # turn (and writing the key dots), instead of one per (sequence, value head, d_v block).
    flush_per_key_head: bool = True
    # The flush as a persistent launch over the full rings only (`replay_flush_kernel`), and the
    # key dots (with key_dots_in_flush) in their own one-warp launch: a step on which no ring is
    # full no longer pays a batch-sized grid of fold-sized programs. Its work items are set by
    # flush_tile_items; flush_per_key_head applies only to the non-persistent flush.
    flush_persistent: bool = True
    flush_programs_per_sm: int = 8
    flush_tile_items: bool = True  # persistent flush items: (row, value head, d_v block), not (row, key head)
    # The step loads only the live ring entries (a mask on the cursor) instead of all L.
    live_ring_loads: bool = True


DEFAULT_STEP_LAUNCH = StepLaunch()


def check_pools(ckpt, ring_k, ring_u, ring_g, cursor) -> None:
    for name, t in (("ckpt", ckpt), ("ring_k", ring_k), ("ring_u", ring_u), ("ring_g", ring_g), ("cursor", cursor)):
        assert t.is_contiguous(), f"{name} pool must be contiguous"
    assert ring_g.dtype == torch.float32, "ring_g holds cumulative log decays in fp32"
    assert ring_k.dtype == ring_u.dtype == ckpt.dtype, "ring_k / ring_u are stored in the state snapshot dtype"


def row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def ring_block(L: int) -> int:
    return max(16, triton.next_power_of_2(L))  # tl.dot needs every dimension >= 16
