"""The ring-key dots rk·k, rk·q of a decode step, once per (sequence, key head) in a one-warp
launch, instead of in every step program (GROUP × d_v / block_v times the same numbers)."""
from __future__ import annotations

import triton
import triton.language as tl

from batchinfer.kernels.replay_ssm.fold import _write_key_dots


@triton.jit
def replay_key_dots_kernel(
    ring_k_ptr, q_ptr, k_ptr, slots_ptr, cursor_ptr, key_dots_ptr,
    stride_rks, stride_rkl, stride_rkh, stride_qb, stride_qh, stride_kb, stride_kh,
    L: tl.constexpr, D_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    LIVE_RING_LOADS: tl.constexpr,
):
    """Grid (sequence, key head): the raw ring-key dots [rk·k, rk·q] for the step, of all L
    entries or, with LIVE_RING_LOADS, of the live ones only (the others written as 0; the step
    masks every entry that is not live either way).

    Its own small launch (one warp, few registers: many programs resident), so that the steps on
    which no ring is full pay only this, not the fold's register footprint.
    """
    pair = tl.program_id(0)
    key_head = tl.program_id(1)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    rows = L
    if LIVE_RING_LOADS:  # as the step: only live entries (a full ring restarts empty)
        n = tl.load(cursor_ptr + slot)
        rows = tl.where(n == L, 0, n)
    _write_key_dots(ring_k_ptr, q_ptr, k_ptr, key_dots_ptr, slot, pair, key_head, tl.num_programs(1), rows,
                    stride_rks, stride_rkl, stride_rkh, stride_qb, stride_qh, stride_kb, stride_kh,
                    D_K, BLOCK_K, BLOCK_L)


def _launch_key_dots(ring_k, q, k, cursor, slots, key_dots, live_only: bool) -> None:
    H_k, L, d_k = ring_k.shape[2], ring_k.shape[1], ring_k.shape[3]
    replay_key_dots_kernel[(slots.numel(), H_k)](
        ring_k, q, k, slots, cursor, key_dots,
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        L=L, D_K=d_k, BLOCK_K=max(16, triton.next_power_of_2(d_k)), BLOCK_L=key_dots.shape[2],
        LIVE_RING_LOADS=live_only, num_warps=1,
    )
