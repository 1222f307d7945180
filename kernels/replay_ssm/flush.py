"""The flush of a decode step: every full ring (cursor == L) folded into its state snapshot before the
step runs, by a persistent launch over the full rings only (or the fold kernel in flush mode)."""
from __future__ import annotations

import triton
import triton.language as tl

from batchinfer.kernels._common import LOOP_AS_WHILE, multiprocessor_count
from batchinfer.kernels.replay_ssm.fold import _fold_tile, _fold_tile_sizes, _launch_fold
from batchinfer.kernels.replay_ssm.launch import DEFAULT_STEP_LAUNCH, StepLaunch, ring_block


# num_seqs (the batch) is not specialised: the graph buckets of one BLOCK_B share a variant.
@triton.jit(do_not_specialize=["num_seqs"])
def replay_flush_kernel(
    ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, cursor_ptr, slots_ptr, num_seqs,
    stride_cs, stride_ch, stride_ck,
    stride_rks, stride_rkl, stride_rkh,
    stride_rus, stride_rul, stride_ruh,
    stride_rgs, stride_rgl,
    H_K: tl.constexpr, GROUP: tl.constexpr, L: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr, FOLD_K: tl.constexpr,
    BLOCK_B: tl.constexpr, TILE_ITEMS: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    """Persistent grid (P,): fold every full ring (cursor == L) among `slots` into its state snapshot.

    Each program reads all B cursors (one small gather), ranks the full rows, and then takes
    work items p, p + P, ...: (full row, key head), folding the GROUP value heads × d_v blocks
    of that key head in turn, or with TILE_ITEMS (full row, value head, d_v block). The work is
    sized by the full rings, not the batch: on a step where no ring is full (15 of 16 steps when a
    batch was admitted together) the launch is one wave of programs that read B cursors and exit.
    """
    offs_b = tl.arange(0, BLOCK_B)
    in_batch = offs_b < num_seqs
    slot_vec = tl.load(slots_ptr + offs_b, mask=in_batch, other=0).to(tl.int64)  # [BB]
    n_vec = tl.load(cursor_ptr + slot_vec, mask=in_batch, other=0)
    full = in_batch & (n_vec == L)
    rank = tl.cumsum(full.to(tl.int32), 0) - 1  # the k-th full row has rank k  [BB]
    # Items per full row: its key heads (each folding GROUP × d_v blocks in turn), or with
    # TILE_ITEMS its (value head, d_v block) tiles — more, shorter items: more parallel folds
    # when few rings are full.
    ITEMS_PER_ROW: tl.constexpr = GROUP * H_K * ((D_V + BLOCK_V - 1) // BLOCK_V) if TILE_ITEMS else H_K
    num_items = tl.sum(full.to(tl.int32), 0) * ITEMS_PER_ROW
    item = tl.program_id(0)
    step = tl.num_programs(0)
    if LOOP_AS_WHILE:  # the interpreter: no runtime-bounded `for`
        while item < num_items:
            _flush_item(ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, slot_vec, full, rank, item,
                        stride_cs, stride_ch, stride_ck, stride_rks, stride_rkl, stride_rkh,
                        stride_rus, stride_rul, stride_ruh, stride_rgs, stride_rgl,
                        H_K, GROUP, L, D_K, D_V, BLOCK_K, BLOCK_V, BLOCK_L, FOLD_K, ITEMS_PER_ROW, TILE_ITEMS)
            item += step
    else:
        for it in tl.range(item, num_items, step):
            _flush_item(ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, slot_vec, full, rank, it,
                        stride_cs, stride_ch, stride_ck, stride_rks, stride_rkl, stride_rkh,
                        stride_rus, stride_rul, stride_ruh, stride_rgs, stride_rgl,
                        H_K, GROUP, L, D_K, D_V, BLOCK_K, BLOCK_V, BLOCK_L, FOLD_K, ITEMS_PER_ROW, TILE_ITEMS)


@triton.jit
def _flush_item(ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, slot_vec, full, rank, item,
                stride_cs, stride_ch, stride_ck, stride_rks, stride_rkl, stride_rkh,
                stride_rus, stride_rul, stride_ruh, stride_rgs, stride_rgl,
                H_K: tl.constexpr, GROUP: tl.constexpr, L: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr, FOLD_K: tl.constexpr,
                ITEMS_PER_ROW: tl.constexpr, TILE_ITEMS: tl.constexpr):
    """Work item `item`: the full row of rank item // ITEMS_PER_ROW, and in it one key head (its
    value heads × d_v blocks folded in turn) or, with TILE_ITEMS, one (value head, d_v block)."""
    slot = tl.sum(tl.where(full & (rank == item // ITEMS_PER_ROW), slot_vec, 0), 0)  # exactly one row matches
    part = item % ITEMS_PER_ROW
    if TILE_ITEMS:
        head = part % (GROUP * H_K)
        _fold_tile(ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, slot, slot, L, head, head // GROUP,
                   part // (GROUP * H_K),
                   stride_cs, stride_ch, stride_ck, stride_rks, stride_rkl, stride_rkh, stride_rus,
                   stride_rul, stride_ruh, stride_rgs, stride_rgl,
                   D_K, D_V, BLOCK_K, BLOCK_V, BLOCK_L, FOLD_K)
    else:
        for i in tl.range(0, GROUP * tl.cdiv(D_V, BLOCK_V)):
            _fold_tile(ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, slot, slot, L,
                       part * GROUP + i % GROUP, part, i // GROUP,
                       stride_cs, stride_ch, stride_ck, stride_rks, stride_rkl, stride_rkh, stride_rus,
                       stride_rul, stride_ruh, stride_rgs, stride_rgl,
                       D_K, D_V, BLOCK_K, BLOCK_V, BLOCK_L, FOLD_K)


def flush_full_rings(ckpt, ring_k, ring_u, ring_g, cursor, slots, *, launch: StepLaunch = DEFAULT_STEP_LAUNCH):
    """Fold each full ring (cursor == L) among `slots` into its state snapshot, in place; others untouched.

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
        BLOCK_K=block_dk, BLOCK_V=block_v, BLOCK_L=ring_block(L), FOLD_K=fold_k,
        BLOCK_B=max(16, triton.next_power_of_2(B)), TILE_ITEMS=launch.flush_tile_items, LOOP_AS_WHILE=LOOP_AS_WHILE,
        num_warps=launch.flush_warps,
    )
