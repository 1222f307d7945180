"""Triton ReplaySSM decode step and fold (math and ring layout: kernels/ref/replay.py).

Decode is bound by memory LATENCY as much as by bytes: per step and value head it reads the
checkpoint C ([d_k, d_v], bf16 in production) and the ring, and writes one entry, and each
program's loads must be in flight together to keep enough bytes moving per SM. So:

1. `_replay_fold_kernel` in flush mode (one program per (sequence, value head), looping over
   d_v blocks) folds every FULL ring (cursor == L) into its checkpoint first; programs of
   other sequences read the cursor and exit. Being its own launch, it finishes before the
   step starts, so the step never folds: no fold registers on the common path, and no race
   between a fold reading ring entry 0 and the step overwriting it.
2. `_replay_step_kernel`, one program per (sequence, value head, d_v block of BLOCK_V), has a
   dependency chain of two round trips: `slots[seq]`, then everything else at once — cursor,
   C tile, ALL L ring entries (whatever the cursor), G's — with no mask that depends on the
   cursor. Validity (index < n) is applied afterwards in registers with tl.where, so stale
   entries (garbage, NaN) never leak; G_n is picked out of the loaded G vector, not
   gathered. Each C chunk serves both Cᵀk and Cᵀq (fp32 accumulation).
   It also appends the new entry: ring_u[n] (its own d_v columns), ring_g[n] (by the
   head's first d_v block) and ring_k[n] (by the first value head of the key-head group).
   Other programs may read entry n concurrently, but entry n is never live for this step
   (it is masked out in registers), so any program order is correct.
Both launches are graph-capturable, without host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import gdn_gate_terms


@dataclass(frozen=True)
class StepLaunch:
    """Launch knobs of the decode step kernel and its flush launch (benchmarks sweep these).

    The step holds what it loads in registers, which caps the C bytes in flight per SM at
    ~64 KB for any unpipelined tile (ptxas, sm_90: ~125 regs/thread for a 16 KB tile at 4
    warps). With d_k chunks and num_stages > 1, Triton issues the chunks as cp.async into
    shared memory up front (3 of 4 chunks here), so more bytes are in flight per register.
    """
    block_v: int = 128
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 4
    flush_block_v: int = 64  # the flush loops over d_v in blocks of this many columns
    flush_warps: int = 4


# Measured best on the H200 (docs/BENCHMARKS.md, 2026-11-29): many small programs (one warp,
# 32 columns of d_v, d_k in 4 pipelined chunks) beat wide tiles — 142 µs vs 352 µs at B=128.
DEFAULT_STEP_LAUNCH = StepLaunch(block_v=32, block_k=32, num_warps=1, num_stages=4)


@triton.jit
def _gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, seq, stride_ab, stride_bb, heads):
    """g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b) for `heads` of one sequence."""
    a = tl.load(a_ptr + seq * stride_ab + heads).to(tl.float32)
    b = tl.load(b_ptr + seq * stride_bb + heads).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads).to(tl.float32)
    A_log = tl.load(A_log_ptr + heads).to(tl.float32)
    return gdn_gate_terms(a, b, A_log, dt_bias)  # the same math as the GDN kernels, one definition


@triton.jit
def _replay_step_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, cursor_ptr, slots_ptr, o_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_ab, stride_bb, stride_ob, stride_oh,
    stride_cs, stride_ch, stride_ck,
    stride_rks, stride_rkl, stride_rkh,
    stride_rus, stride_rul, stride_ruh,
    stride_rgs, stride_rgl,
    scale,
    GROUP: tl.constexpr, L: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    key_head = head // GROUP
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < D_V
    offs_l = tl.arange(0, BLOCK_L)
    in_ring = offs_l < L  # a constant mask: no load below waits for the cursor
    offs_dk = tl.arange(0, BLOCK_DK)
    mask_dk = offs_dk < D_K

    # The new token's inputs do not depend on the slot: issued first.
    q_all = tl.load(q_ptr + seq * stride_qb + key_head * stride_qh + offs_dk, mask=mask_dk, other=0.0)
    k_all = tl.load(k_ptr + seq * stride_kb + key_head * stride_kh + offs_dk, mask=mask_dk, other=0.0)
    v = tl.load(v_ptr + seq * stride_vb + head * stride_vh + offs_v, mask=mask_v, other=0.0)
    g, beta = _gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, seq, stride_ab, stride_bb, head)

    # Everything slot-dependent is issued together, one round trip after `slot`.
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    n_stored = tl.load(cursor_ptr + slot).to(tl.int32)
    ring_g_vec = tl.load(ring_g_ptr + slot * stride_rgs + offs_l * stride_rgl + head,
                         mask=in_ring, other=0.0)  # cumulative log decays, all L entries  [BL]
    ru = tl.load(ring_u_ptr + slot * stride_rus + offs_l[:, None] * stride_rul + head * stride_ruh
                 + offs_v[None, :], mask=in_ring[:, None] & mask_v[None, :], other=0.0)  # [BL, BV]
    c_base = ckpt_ptr + slot * stride_cs + head * stride_ch
    rk_base = ring_k_ptr + slot * stride_rks + offs_l[:, None] * stride_rkl + key_head * stride_rkh

    q_all = q_all.to(tl.float32)
    k_all = k_all.to(tl.float32)
    q_scale = tl.rsqrt(tl.sum(q_all * q_all) + 1e-6) * scale
    k_scale = tl.rsqrt(tl.sum(k_all * k_all) + 1e-6)
    k_dot_q = tl.sum(k_all * q_all) * (q_scale * k_scale)

    # Raw dot products over d_k chunks (q/k scales applied once at the end).
    c_dot_k = tl.zeros([BLOCK_V], tl.float32)
    c_dot_q = tl.zeros([BLOCK_V], tl.float32)
    rk_dot_k = tl.zeros([BLOCK_L], tl.float32)
    rk_dot_q = tl.zeros([BLOCK_L], tl.float32)
    for k0 in tl.range(0, D_K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D_K
        c = tl.load(c_base + offs_k[:, None] * stride_ck + offs_v[None, :],
                    mask=mask_k[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # [BK, BV]
        rk = tl.load(rk_base + offs_k[None, :], mask=in_ring[:, None] & mask_k[None, :],
                     other=0.0).to(tl.float32)  # [BL, BK], stale rows included
        k = tl.load(k_ptr + seq * stride_kb + key_head * stride_kh + offs_k, mask=mask_k, other=0.0)
        q = tl.load(q_ptr + seq * stride_qb + key_head * stride_qh + offs_k, mask=mask_k, other=0.0)
        k = k.to(tl.float32)  # [BK]
        q = q.to(tl.float32)  # [BK]
        c_dot_k += tl.sum(c * k[:, None], 0)
        c_dot_q += tl.sum(c * q[:, None], 0)
        rk_dot_k += tl.sum(rk * k[None, :], 1)
        rk_dot_q += tl.sum(rk * q[None, :], 1)

    # Validity in registers. A full ring was folded by the flush launch: it restarts empty.
    n = tl.where(n_stored == L, 0, n_stored)
    live = offs_l < n  # entries of S_n; stale ones may hold NaN, so select, never multiply
    g_new = tl.sum(tl.where(offs_l == n - 1, ring_g_vec, 0.0)) + g  # G_{n+1} = G_n + g (G_0 = 0)
    w = tl.where(live, tl.exp(g_new - ring_g_vec), 0.0)  # exp(G_{n+1} − G_i)  [BL]
    coef_k = tl.where(live, w * rk_dot_k * k_scale, 0.0)  # [BL]
    coef_q = tl.where(live, w * rk_dot_q * q_scale, 0.0)  # [BL]
    ru = tl.where(live[:, None], ru.to(tl.float32), 0.0)  # [BL, BV]
    decay = tl.exp(g_new)

    decayed_s_k = decay * k_scale * c_dot_k + tl.sum(coef_k[:, None] * ru, 0)  # (exp(g)·S_n)ᵀ k  [BV]
    u = beta * (v.to(tl.float32) - decayed_s_k)  # [BV]
    o = decay * q_scale * c_dot_q + tl.sum(coef_q[:, None] * ru, 0) + k_dot_q * u  # S_{n+1}ᵀ q  [BV]
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)

    # Append entry n: each part written by exactly one program.
    tl.store(ring_u_ptr + slot * stride_rus + n * stride_rul + head * stride_ruh + offs_v,
             u.to(ring_u_ptr.dtype.element_ty), mask=mask_v)
    tl.store(ring_g_ptr + slot * stride_rgs + n * stride_rgl + head, g_new, mask=v_block == 0)
    writes_key = (v_block == 0) & (head % GROUP == 0)
    tl.store(ring_k_ptr + slot * stride_rks + n * stride_rkl + key_head * stride_rkh + offs_dk,
             (k_all * k_scale).to(ring_k_ptr.dtype.element_ty), mask=mask_dk & writes_key)


@triton.jit
def _replay_fold_kernel(
    ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, cursor_ptr, src_ptr, dst_ptr,
    stride_cs, stride_ch, stride_ck,
    stride_rks, stride_rkl, stride_rkh,
    stride_rus, stride_rul, stride_ruh,
    stride_rgs, stride_rgl,
    GROUP: tl.constexpr, L: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr, FULL_ONLY: tl.constexpr,
):
    """ckpt[dst] <- exp(G_n)·C[src] + Σ_{i<n} exp(G_n − G_i) k_i ⊗ u_i for one (pair, value head).

    FULL_ONLY (the step's flush): pairs whose ring is not full do nothing.
    """
    pair = tl.program_id(0)
    head = tl.program_id(1)
    src = tl.load(src_ptr + pair).to(tl.int64)
    n = tl.load(cursor_ptr + src).to(tl.int32)
    if FULL_ONLY:
        active = n == L
    else:
        active = n >= 0
    if active:
        dst = tl.load(dst_ptr + pair).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        offs_l = tl.arange(0, BLOCK_L)
        mask_k = offs_k < D_K
        valid = offs_l < n
        rk = tl.load(ring_k_ptr + src * stride_rks + offs_l[:, None] * stride_rkl + (head // GROUP) * stride_rkh
                     + offs_k[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        ring_g_vec = tl.load(ring_g_ptr + src * stride_rgs + offs_l * stride_rgl + head, mask=valid, other=0.0)
        g_end = tl.sum(tl.where(offs_l == n - 1, ring_g_vec, 0.0))
        w = tl.where(valid, tl.exp(g_end - ring_g_vec), 0.0)  # [BL]
        weighted_k_t = tl.trans(rk * w[:, None])  # [BK, BL]
        decay = tl.exp(g_end)
        for v0 in tl.range(0, D_V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < D_V
            ru = tl.load(ring_u_ptr + src * stride_rus + offs_l[:, None] * stride_rul + head * stride_ruh
                         + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
            tile = offs_k[:, None] * stride_ck + offs_v[None, :]
            c_mask = mask_k[:, None] & mask_v[None, :]
            c = tl.load(ckpt_ptr + src * stride_cs + head * stride_ch + tile, mask=c_mask, other=0.0)
            folded = decay * c.to(tl.float32) + tl.dot(weighted_k_t, ru, input_precision="ieee")  # [BK, BV]
            tl.store(ckpt_ptr + dst * stride_cs + head * stride_ch + tile,
                     folded.to(ckpt_ptr.dtype.element_ty), mask=c_mask)


def _check_pools(ckpt, ring_k, ring_u, ring_g, cursor) -> None:
    for name, t in (("ckpt", ckpt), ("ring_k", ring_k), ("ring_u", ring_u), ("ring_g", ring_g), ("cursor", cursor)):
        assert t.is_contiguous(), f"{name} pool must be contiguous"
    assert ring_g.dtype == torch.float32, "ring_g holds cumulative log decays in fp32"


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, *, full_only: bool,
                 block_v: int, num_warps: int) -> None:
    H_v, d_k, d_v = ckpt.shape[1], ckpt.shape[2], ckpt.shape[3]
    L = ring_k.shape[1]
    _replay_fold_kernel[(src_slots.numel(), H_v)](
        ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots,
        ckpt.stride(0), ckpt.stride(1), ckpt.stride(2),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        ring_u.stride(0), ring_u.stride(1), ring_u.stride(2),
        ring_g.stride(0), ring_g.stride(1),
        GROUP=H_v // ring_k.shape[2], L=L, D_K=d_k, D_V=d_v,
        BLOCK_K=max(16, triton.next_power_of_2(d_k)),
        BLOCK_V=min(max(16, block_v), max(16, triton.next_power_of_2(d_v))),
        BLOCK_L=max(16, triton.next_power_of_2(L)),  # tl.dot needs every dimension >= 16
        FULL_ONLY=full_only, num_warps=num_warps,
    )


def flush_full_rings(ckpt, ring_k, ring_u, ring_g, cursor, slots, *, launch: StepLaunch = DEFAULT_STEP_LAUNCH):
    """Fold each full ring (cursor == L) among `slots` into its checkpoint, in place; others untouched.

    The first launch of replay_decode (exposed so benchmarks can time it alone). Cursors and
    rings are not changed: the step then treats cursor == L as an empty ring.
    """
    _launch_fold(ckpt, ring_k, ring_u, ring_g, cursor, slots, slots, full_only=True,
                 block_v=launch.flush_block_v, num_warps=launch.flush_warps)


def replay_decode(q, k, v, a, b, A_log, dt_bias, ckpt, ring_k, ring_u, ring_g, cursor, slots,
                  *, out=None, launch: StepLaunch = DEFAULT_STEP_LAUNCH, **knobs):
    """One ReplaySSM step per sequence (contract: docs/MODULES.md; math: kernels/ref/replay.py).

    q, k [B, H_k, d_k]; v [B, H_v, d_v]; a, b [B, H_v]; slots [B] distinct. Returns o
    [B, H_v, d_v] in q.dtype (`out` may supply it). `launch` (or its fields as keywords)
    tunes the two launches.
    """
    _check_pools(ckpt, ring_k, ring_u, ring_g, cursor)
    launch = StepLaunch(**{**launch.__dict__, **knobs})
    B, H_k, d_k = k.shape
    H_v, d_v = v.shape[1], v.shape[2]
    L = ring_k.shape[1]
    q, k, v, a, b = (_row_major(t) for t in (q, k, v, a, b))
    o = torch.empty((B, H_v, d_v), dtype=q.dtype, device=q.device) if out is None else out
    if B == 0:
        return o
    flush_full_rings(ckpt, ring_k, ring_u, ring_g, cursor, slots, launch=launch)
    block_dk = triton.next_power_of_2(d_k)
    block_k = min(max(16, launch.block_k), block_dk)
    block_v = min(max(16, launch.block_v), max(16, triton.next_power_of_2(d_v)))
    _replay_step_kernel[(B, H_v, triton.cdiv(d_v, block_v))](
        q, k, v, a, b, A_log, dt_bias, ckpt, ring_k, ring_u, ring_g, cursor, slots, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), o.stride(0), o.stride(1),
        ckpt.stride(0), ckpt.stride(1), ckpt.stride(2),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        ring_u.stride(0), ring_u.stride(1), ring_u.stride(2),
        ring_g.stride(0), ring_g.stride(1),
        d_k ** -0.5,
        GROUP=H_v // H_k, L=L, D_K=d_k, D_V=d_v,
        BLOCK_DK=block_dk, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_L=triton.next_power_of_2(L),
        NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
    )
    return o


def replay_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, *, block_v: int = 64,
                num_warps: int = 4):
    """ckpt[dst] <- state of src at its cursor, rounded to the ckpt dtype. Cursors untouched.

    A pair may fold in place (dst == src), but no dst may be another pair's src: programs run
    in any order, so that would read a half-written checkpoint.
    """
    _check_pools(ckpt, ring_k, ring_u, ring_g, cursor)
    if src_slots.numel() == 0:
        return
    _launch_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, full_only=False,
                 block_v=block_v, num_warps=num_warps)
