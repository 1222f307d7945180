"""Triton ReplaySSM decode step and fold (math and ring layout: kernels/ref/replay.py).

Decode is bound by memory latency and, with the loads in flight, by the instructions the SMs
issue, not by bytes (Nsight Compute: docs/BENCHMARKS.md, "ReplaySSM: tensor-core dots and many
small programs"). So the work per loaded byte is kept small. With the default launch knobs a step is
three launches (kernels in kernels/replay_ssm_kernels.py):

1. `replay_flush_kernel`, a persistent grid (8 programs per SM), folds every FULL ring (cursor
   == L) into its checkpoint: each program ranks the batch's full rows from the cursors and takes
   work items (full row, value head, d_v block) in turn. Sized by the full rings, not the batch, so a step on
   which no ring is full pays one wave of programs that read B cursors. Being its own launch,
   it finishes before the step starts, so the step never folds: no fold registers on the common
   path, and no race between a fold reading ring entry 0 and the step overwriting it.
   (`flush_persistent=False`: `replay_fold_kernel` in flush mode, one program per (sequence,
   key head) or per (sequence, value head, d_v block), most of which read the cursor and exit.)
2. `replay_key_dots_kernel`, one one-warp program per (sequence, key head), writes the ring-key
   dots rk·k, rk·q for the step, which otherwise recomputes them in every program (GROUP × d_v /
   block_v times the same numbers, the same ring keys re-read from L2 each time).
3. `replay_step_kernel`, one program per (sequence, value head, d_v block of BLOCK_V), has a
   dependency chain of two round trips for the bulk: `slots[seq]`, then cursor and C tile at
   once. With `live_ring_loads` the ring entries wait for the cursor and only the live ones are
   loaded (half the ring on average, for a third dependent round trip that only the ring
   loads wait for; docs/BENCHMARKS.md, "ReplaySSM: the flush launch and live ring loads"). Validity (index < n) is applied in registers with tl.where
   either way, so stale entries (garbage, NaN) never leak; G_n is picked out of the loaded G
   vector, not gathered.
   With `tensor_cores` the products are mma's with N = 2: raw k and q are the two columns of
   a [BLOCK_K, 2] operand, so Cᵀ[BV, BK] @ [k q] gives Cᵀk and Cᵀq in one accumulator (the mma
   pads N to 8; the columns split in-thread, no reduction), rk[BL, BK] @ [k q] the ring-key
   dots, and ruᵀ[BV, BL] @ coef[BL, 2] the ring's share. 16-bit operands are exact; an fp32
   operand against a 16-bit one goes in as its high and low 16-bit parts (two mma's: ~16
   mantissa bits, fp32 sums); fp32 against fp32 is true fp32 (`ieee`).
   It also appends the new entry: ring_u[n] (its own d_v columns), ring_g[n] (by the
   head's first d_v block) and ring_k[n] (by the first value head of the key-head group).
   Other programs may read entry n concurrently, but entry n is never live for this step
   (it is masked out in registers), so any program order is correct.
All launches are graph-capturable, without host sync.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from kernels._common import LOOP_AS_WHILE, multiprocessor_count
from kernels.replay_ssm_kernels import (
    replay_flush_kernel, replay_fold_kernel, replay_key_dots_kernel, replay_step_kernel,
)


@dataclass(frozen=True)
class StepLaunch:
    """Launch knobs of the decode step kernel and its flush launch (benchmarks sweep these).

    The step holds what it loads in registers; with d_k chunks and num_stages > 1, Triton
    issues the chunks as cp.async into shared memory up front, so more bytes are in flight
    per register. Field defaults: one warp, 32 columns of d_v, every optional path off; the op
    runs DEFAULT_STEP_LAUNCH.
    """
    block_v: int = 32
    block_k: int = 32
    num_warps: int = 1
    num_stages: int = 4
    tensor_cores: bool = True  # d_k dots as mma's; False: broadcast-multiply + tl.sum (FMA)
    key_dots_in_flush: bool = False  # rk·k, rk·q once per (seq, key head) in the flush launch
    flush_block_v: int = 32  # the flush folds one [d_k, flush_block_v] tile per program,
    flush_block_k: int = 16  # in chunks of this many d_k rows
    flush_warps: int = 1
    # One flush program per (sequence, key head), folding its GROUP value heads × d_v blocks in
    # turn (and writing the key dots), instead of one per (sequence, value head, d_v block).
    flush_per_key_head: bool = False
    # The flush as a persistent launch over the full rings only (`replay_flush_kernel`), and the
    # key dots (with key_dots_in_flush) in their own one-warp launch: a step on which no ring is
    # full no longer pays a batch-sized grid of fold-sized programs. Its work items are set by
    # flush_tile_items; flush_per_key_head applies only to the non-persistent flush.
    flush_persistent: bool = False
    flush_programs_per_sm: int = 2
    flush_tile_items: bool = False  # persistent flush items: (row, value head, d_v block), not (row, key head)
    # The step loads only the live ring entries (a mask on the cursor) instead of all L.
    live_ring_loads: bool = False


# The H200 sweeps' best (CUDA-graph timing, `python -m benchmarks.bench_replay_attn --replay`):
# 64-column tiles over 2 warps, d_k in 64-row chunks 3 deep, the ring-key dots once per key head
# in their own launch, only the live ring entries loaded, and the flush a persistent launch (8
# programs per SM) over the full rings only, in (row, value head, d_v block) work items: more
# folds in flight when few rings are full, the common case under continuous admission.
# docs/BENCHMARKS.md: "ReplaySSM: tensor-core dots and many small programs", "ReplaySSM: the
# flush launch and live ring loads".
DEFAULT_STEP_LAUNCH = StepLaunch(block_v=64, block_k=64, num_warps=2, num_stages=3, key_dots_in_flush=True,
                                 flush_block_v=128, flush_block_k=32, flush_warps=4, flush_per_key_head=True,
                                 flush_persistent=True, flush_programs_per_sm=8, flush_tile_items=True,
                                 live_ring_loads=True)


def _check_pools(ckpt, ring_k, ring_u, ring_g, cursor) -> None:
    for name, t in (("ckpt", ckpt), ("ring_k", ring_k), ("ring_u", ring_u), ("ring_g", ring_g), ("cursor", cursor)):
        assert t.is_contiguous(), f"{name} pool must be contiguous"
    assert ring_g.dtype == torch.float32, "ring_g holds cumulative log decays in fp32"
    assert ring_k.dtype == ring_u.dtype == ckpt.dtype, "ring_k / ring_u are stored in the checkpoint dtype"


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _ring_block(L: int) -> int:
    return max(16, triton.next_power_of_2(L))  # tl.dot needs every dimension >= 16


def _fold_tile_sizes(ckpt, block_v: int, block_k: int) -> tuple[int, int, int]:
    """(BLOCK_V, BLOCK_K, FOLD_K) of a fold tile: d_v columns, padded d_k, d_k rows per chunk."""
    d_k, d_v = ckpt.shape[2], ckpt.shape[3]
    block_v = min(max(16, block_v), max(16, triton.next_power_of_2(d_v)))
    block_dk = max(16, triton.next_power_of_2(d_k))
    fold_k = min(max(16, block_k), block_dk)
    if ckpt.dtype == torch.float32:
        fold_k = min(fold_k, 32)  # fp32 (FMA dot): ptxas spills above
    return block_v, block_dk, fold_k


def _launch_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, *, full_only: bool,
                 block_v: int, block_k: int, num_warps: int, q=None, k=None, key_dots=None,
                 per_key_head: bool = False) -> None:
    """Grid (pair, value head, d_v block), or (pair, key head) with `per_key_head`. With
    key_dots, q / k are the step's inputs."""
    H_v, d_k, d_v = ckpt.shape[1], ckpt.shape[2], ckpt.shape[3]
    block_v, block_dk, fold_k = _fold_tile_sizes(ckpt, block_v, block_k)
    with_dots = key_dots is not None
    q_, k_ = (q, k) if with_dots else (ring_k, ring_k)  # placeholders: never read
    H_k = ring_k.shape[2]
    grid = (src_slots.numel(), H_k, 1) if per_key_head else (src_slots.numel(), H_v, triton.cdiv(d_v, block_v))
    replay_fold_kernel[grid](
        ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots,
        q_, k_, key_dots if with_dots else ring_g,
        ckpt.stride(0), ckpt.stride(1), ckpt.stride(2),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        ring_u.stride(0), ring_u.stride(1), ring_u.stride(2),
        ring_g.stride(0), ring_g.stride(1),
        q_.stride(0), q_.stride(1), k_.stride(0), k_.stride(1),
        GROUP=H_v // ring_k.shape[2], L=ring_k.shape[1], D_K=d_k, D_V=d_v,
        BLOCK_K=block_dk, BLOCK_V=block_v, BLOCK_L=_ring_block(ring_k.shape[1]),
        FULL_ONLY=full_only, FOLD_K=fold_k, KEY_DOTS=with_dots, PER_KEY_HEAD=per_key_head, num_warps=num_warps,
    )


def flush_full_rings(ckpt, ring_k, ring_u, ring_g, cursor, slots, *, launch: StepLaunch = DEFAULT_STEP_LAUNCH):
    """Fold each full ring (cursor == L) among `slots` into its checkpoint, in place; others untouched.

    Runs before replay_decode's step launch (exposed so benchmarks can time it alone). Cursors
    and rings are not changed: the step then treats cursor == L as an empty ring.
    """
    if launch.flush_persistent:
        _launch_flush_persistent(ckpt, ring_k, ring_u, ring_g, cursor, slots, launch)
        return
    _launch_fold(ckpt, ring_k, ring_u, ring_g, cursor, slots, slots, full_only=True,
                 block_v=launch.flush_block_v, block_k=launch.flush_block_k, num_warps=launch.flush_warps,
                 per_key_head=launch.flush_per_key_head)


def _launch_flush_persistent(ckpt, ring_k, ring_u, ring_g, cursor, slots, launch: StepLaunch) -> None:
    B = slots.numel()
    H_v, d_k, d_v = ckpt.shape[1], ckpt.shape[2], ckpt.shape[3]
    H_k, L = ring_k.shape[2], ring_k.shape[1]
    block_v, block_dk, fold_k = _fold_tile_sizes(ckpt, launch.flush_block_v, launch.flush_block_k)
    items = B * (H_v * triton.cdiv(d_v, block_v) if launch.flush_tile_items else H_k)  # all rings full
    programs = min(items, launch.flush_programs_per_sm * multiprocessor_count(ckpt.device))
    replay_flush_kernel[(programs,)](
        ckpt, ring_k, ring_u, ring_g, cursor, slots, B,
        ckpt.stride(0), ckpt.stride(1), ckpt.stride(2),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        ring_u.stride(0), ring_u.stride(1), ring_u.stride(2),
        ring_g.stride(0), ring_g.stride(1),
        H_K=H_k, GROUP=H_v // H_k, L=L, D_K=d_k, D_V=d_v,
        BLOCK_K=block_dk, BLOCK_V=block_v, BLOCK_L=_ring_block(L), FOLD_K=fold_k,
        BLOCK_B=max(16, triton.next_power_of_2(B)), TILE_ITEMS=launch.flush_tile_items, LOOP_AS_WHILE=LOOP_AS_WHILE,
        num_warps=launch.flush_warps,
    )


def _launch_key_dots(ring_k, q, k, cursor, slots, key_dots, live_only: bool) -> None:
    H_k, L, d_k = ring_k.shape[2], ring_k.shape[1], ring_k.shape[3]
    replay_key_dots_kernel[(slots.numel(), H_k)](
        ring_k, q, k, slots, cursor, key_dots,
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        L=L, D_K=d_k, BLOCK_K=max(16, triton.next_power_of_2(d_k)), BLOCK_L=key_dots.shape[2],
        LIVE_RING_LOADS=live_only, num_warps=1,
    )


def replay_decode(q, k, v, a, b, A_log, dt_bias, ckpt, ring_k, ring_u, ring_g, cursor, slots,
                  *, out=None, launch: StepLaunch = DEFAULT_STEP_LAUNCH, **knobs):
    """One ReplaySSM step per sequence (contract: docs/MODULES.md; math: kernels/ref/replay.py).

    q, k [B, H_k, d_k]; v [B, H_v, d_v]; a, b [B, H_v]; slots [B] distinct. Returns o
    [B, H_v, d_v] in q.dtype (`out` may supply it). `launch` (or its fields as keywords)
    tunes the launches (module docstring).
    """
    _check_pools(ckpt, ring_k, ring_u, ring_g, cursor)
    if knobs:  # keyword overrides (benchmarks/tests); the model's per-layer call builds nothing
        launch = replace(launch, **knobs)
    B, H_k, d_k = k.shape
    H_v, d_v = v.shape[1], v.shape[2]
    L = ring_k.shape[1]
    assert q.dtype == k.dtype, "q and k share a dtype (one mma operand)"
    q, k, v, a, b = (_row_major(t) for t in (q, k, v, a, b))
    o = torch.empty((B, H_v, d_v), dtype=q.dtype, device=q.device) if out is None else out
    if B == 0:
        return o
    block_l = _ring_block(L) if launch.tensor_cores or launch.key_dots_in_flush else triton.next_power_of_2(L)
    key_dots = None
    if launch.key_dots_in_flush:
        key_dots = torch.empty((B, H_k, block_l, 2), dtype=torch.float32, device=q.device)
    if key_dots is not None and not launch.flush_persistent:  # the flush launch writes the key dots
        _launch_fold(ckpt, ring_k, ring_u, ring_g, cursor, slots, slots, full_only=True,
                     block_v=launch.flush_block_v, block_k=launch.flush_block_k, num_warps=launch.flush_warps,
                     q=q, k=k, key_dots=key_dots, per_key_head=launch.flush_per_key_head)
    else:
        if key_dots is not None:
            _launch_key_dots(ring_k, q, k, cursor, slots, key_dots, launch.live_ring_loads)
        flush_full_rings(ckpt, ring_k, ring_u, ring_g, cursor, slots, launch=launch)
    block_dk = triton.next_power_of_2(d_k)
    block_k = min(max(16, launch.block_k), block_dk)
    block_v = min(max(16, launch.block_v), max(16, triton.next_power_of_2(d_v)))
    replay_step_kernel[(B, H_v, triton.cdiv(d_v, block_v))](
        q, k, v, a, b, A_log, dt_bias, ckpt, ring_k, ring_u, ring_g, cursor, slots,
        ring_g if key_dots is None else key_dots, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), o.stride(0), o.stride(1),
        ckpt.stride(0), ckpt.stride(1), ckpt.stride(2),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        ring_u.stride(0), ring_u.stride(1), ring_u.stride(2),
        ring_g.stride(0), ring_g.stride(1),
        d_k ** -0.5,
        GROUP=H_v // H_k, L=L, D_K=d_k, D_V=d_v,
        BLOCK_DK=block_dk, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_L=block_l,
        NUM_STAGES=launch.num_stages, TENSOR_CORES=launch.tensor_cores,
        SPLIT=ckpt.dtype != torch.float32 and q.dtype != ckpt.dtype,
        KEY_DOTS_GIVEN=key_dots is not None, LIVE_RING_LOADS=launch.live_ring_loads, num_warps=launch.num_warps,
    )
    return o


def replay_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, *, block_v: int = 32,
                block_k: int = 16, num_warps: int = 1):
    """ckpt[dst] <- state of src at its cursor, rounded to the ckpt dtype. Cursors untouched.

    A pair may fold in place (dst == src), but no dst may be another pair's src: programs run
    in any order, so that would read a half-written checkpoint.
    """
    _check_pools(ckpt, ring_k, ring_u, ring_g, cursor)
    if src_slots.numel() == 0:
        return
    _launch_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, full_only=False,
                 block_v=block_v, block_k=block_k, num_warps=num_warps)
