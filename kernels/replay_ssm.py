"""Triton ReplaySSM decode step and fold (math and ring layout: kernels/ref/replay.py).

Decode is bound by memory: per step and value head it must read the checkpoint C
([d_k, d_v], bf16 in production) and the n live ring entries, and write one entry. So the
step is split for memory-level parallelism: one program per (sequence, value head, d_v
block of BLOCK_V columns) streams its C tile once, in BLOCK_K-row chunks, and uses each
chunk for both Cᵀk and Cᵀq (fp32 accumulation). At B=128, 48 value heads and
BLOCK_V=32 that is 24576 programs of ~13 KB each, enough loads in flight on every SM.

Two launches per step, both graph-capturable and without host sync:
1. `_replay_step_kernel` computes o and u. On a full ring (cursor == L) it first folds the
   ring into its own C tile (a [BLOCK_K, L] x [L, BLOCK_V] tl.dot), stores the tile rounded
   to the checkpoint dtype and continues from the rounded tile (what later steps will
   see). It writes only what it alone reads: its C tile and its d_v columns of
   ring_u[n] (after a barrier, since on a full ring n = 0 is an entry the fold just read).
2. `_replay_append_kernel` (one program per sequence) writes the shared parts of the new
   entry, ring_k[n] (per key head) and ring_g[n] (per value head). Every program of
   launch 1 for a full ring reads entry 0 of those for its fold; running the write after
   the whole launch is what makes overwriting entry 0 safe with any program order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class StepLaunch:
    """Launch knobs of the decode step kernel (benchmarks sweep these)."""
    block_v: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 1


DEFAULT_STEP_LAUNCH = StepLaunch()


@triton.jit
def _gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, seq, stride_ab, stride_bb, heads):
    """g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b) for `heads` of one sequence."""
    a = tl.load(a_ptr + seq * stride_ab + heads).to(tl.float32)
    b = tl.load(b_ptr + seq * stride_bb + heads).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + heads).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return -tl.exp(tl.load(A_log_ptr + heads).to(tl.float32)) * softplus, tl.sigmoid(b)


@triton.jit
def _fold_tile(c, rk, ru, w_fold, decay_fold):
    """exp(G_end)·C + Σ_i exp(G_end − G_i) k_i ⊗ u_i for one [BLOCK_K, BLOCK_V] tile.

    c [BK, BV] fp32; rk [BL, BK], ru [BL, BV] fp32 (rows past the ring zeroed);
    w_fold [BL] = exp(G_end − G_i), 0 for rows without data; decay_fold = exp(G_end).
    """
    weighted_k = rk * w_fold[:, None]  # [BL, BK]
    return decay_fold * c + tl.dot(tl.trans(weighted_k), ru, input_precision="ieee")  # [BK, BV]


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
    key_head = head // GROUP
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < D_V
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    c_base = ckpt_ptr + slot * stride_cs + head * stride_ch
    n_stored = tl.load(cursor_ptr + slot).to(tl.int32)
    full = n_stored == L
    n = tl.where(full, 0, n_stored)  # a full ring is folded below and restarts empty

    # L2 norms of q and k over the whole head (the C loop below works in d_k chunks).
    offs_dk = tl.arange(0, BLOCK_DK)
    q_all = tl.load(q_ptr + seq * stride_qb + key_head * stride_qh + offs_dk, mask=offs_dk < D_K, other=0.0)
    k_all = tl.load(k_ptr + seq * stride_kb + key_head * stride_kh + offs_dk, mask=offs_dk < D_K, other=0.0)
    q_all = q_all.to(tl.float32)
    k_all = k_all.to(tl.float32)
    q_scale = tl.rsqrt(tl.sum(q_all * q_all) + 1e-6) * scale
    k_scale = tl.rsqrt(tl.sum(k_all * k_all) + 1e-6)
    k_dot_q = tl.sum(k_all * q_all) * (q_scale * k_scale)

    g, beta = _gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, seq, stride_ab, stride_bb, head)
    offs_l = tl.arange(0, BLOCK_L)
    stored = offs_l < n_stored  # entries holding data (all L when full, for the fold)
    live = offs_l < n  # entries that are part of S_n for this step
    ring_g_vec = tl.load(ring_g_ptr + slot * stride_rgs + offs_l * stride_rgl + head,
                         mask=stored, other=0.0)  # cumulative log decays  [BL]
    g_stored_end = tl.sum(tl.where(offs_l == n_stored - 1, ring_g_vec, 0.0))
    g_new = tl.where(full, 0.0, g_stored_end) + g  # G_{n+1}
    w = tl.where(live, tl.exp(g_new - ring_g_vec), 0.0)  # [BL]
    decay = tl.exp(g_new)
    w_fold = tl.where(stored, tl.exp(g_stored_end - ring_g_vec), 0.0)  # [BL], used on a full ring
    decay_fold = tl.exp(g_stored_end)

    ru_ptrs = ring_u_ptr + slot * stride_rus + offs_l[:, None] * stride_rul + head * stride_ruh + offs_v[None, :]
    ru = tl.load(ru_ptrs, mask=stored[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # [BL, BV]

    c_dot_k = tl.zeros([BLOCK_V], tl.float32)
    c_dot_q = tl.zeros([BLOCK_V], tl.float32)
    rk_dot_k = tl.zeros([BLOCK_L], tl.float32)
    rk_dot_q = tl.zeros([BLOCK_L], tl.float32)
    for k0 in tl.range(0, D_K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D_K
        c_ptrs = c_base + offs_k[:, None] * stride_ck + offs_v[None, :]
        c_mask = mask_k[:, None] & mask_v[None, :]
        c = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)  # [BK, BV]
        rk = tl.load(ring_k_ptr + slot * stride_rks + offs_l[:, None] * stride_rkl + key_head * stride_rkh
                     + offs_k[None, :], mask=stored[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BL, BK]
        k = tl.load(k_ptr + seq * stride_kb + key_head * stride_kh + offs_k, mask=mask_k, other=0.0)
        q = tl.load(q_ptr + seq * stride_qb + key_head * stride_qh + offs_k, mask=mask_k, other=0.0)
        k = k.to(tl.float32) * k_scale  # [BK]
        q = q.to(tl.float32) * q_scale  # [BK]
        if full:
            # Flush: C <- S_L, rounded to the checkpoint dtype once.
            folded = _fold_tile(c, rk, ru, w_fold, decay_fold).to(ckpt_ptr.dtype.element_ty)
            tl.store(c_ptrs, folded, mask=c_mask)
            c = folded.to(tl.float32)
        c_dot_k += tl.sum(c * k[:, None], 0)
        c_dot_q += tl.sum(c * q[:, None], 0)
        rk_dot_k += tl.sum(rk * k[None, :], 1)
        rk_dot_q += tl.sum(rk * q[None, :], 1)

    v = tl.load(v_ptr + seq * stride_vb + head * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    decayed_s_k = decay * c_dot_k + tl.sum((w * rk_dot_k)[:, None] * ru, 0)  # (exp(g)·S_n)ᵀ k  [BV]
    u = beta * (v - decayed_s_k)  # [BV]
    o = decay * c_dot_q + tl.sum((w * rk_dot_q)[:, None] * ru, 0) + k_dot_q * u
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    # On a full ring n = 0 is a row of `ru` that other threads of this program loaded: all reads first.
    tl.debug_barrier()
    tl.store(ring_u_ptr + slot * stride_rus + n * stride_rul + head * stride_ruh + offs_v,
             u.to(ring_u_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _replay_append_kernel(
    k_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, ring_k_ptr, ring_g_ptr, cursor_ptr, slots_ptr,
    stride_kb, stride_kh, stride_ab, stride_bb,
    stride_rks, stride_rkl, stride_rkh, stride_rgs, stride_rgl,
    H_K: tl.constexpr, H_V: tl.constexpr, L: tl.constexpr, D_K: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HV: tl.constexpr, BLOCK_DK: tl.constexpr,
):
    """Entry n of ring_k (L2-normalised k, all key heads) and ring_g (G_{n+1}, all value heads)."""
    seq = tl.program_id(0)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    n_stored = tl.load(cursor_ptr + slot).to(tl.int32)
    full = n_stored == L
    n = tl.where(full, 0, n_stored)

    offs_hk = tl.arange(0, BLOCK_HK)
    offs_dk = tl.arange(0, BLOCK_DK)
    mask = (offs_hk < H_K)[:, None] & (offs_dk < D_K)[None, :]
    k = tl.load(k_ptr + seq * stride_kb + offs_hk[:, None] * stride_kh + offs_dk[None, :],
                mask=mask, other=0.0).to(tl.float32)  # [BHK, BDK]
    k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    tl.store(ring_k_ptr + slot * stride_rks + n * stride_rkl + offs_hk[:, None] * stride_rkh + offs_dk[None, :],
             k.to(ring_k_ptr.dtype.element_ty), mask=mask)

    heads = tl.arange(0, BLOCK_HV)
    mask_h = heads < H_V
    heads = tl.where(mask_h, heads, 0)  # padded lanes compute head 0 and store nothing
    g, _ = _gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, seq, stride_ab, stride_bb, heads)
    # G_{n+1} = G_n + g, the value the step kernel used (G_n = 0 after a fold or on an empty ring).
    g_prev = tl.load(ring_g_ptr + slot * stride_rgs + (n_stored - 1) * stride_rgl + heads,
                     mask=mask_h & (n_stored > 0) & (n_stored < L), other=0.0)
    g_new = g_prev + g  # g_prev is 0 on an empty or full ring (masked load)
    tl.store(ring_g_ptr + slot * stride_rgs + n * stride_rgl + heads, g_new, mask=mask_h)


@triton.jit
def _replay_fold_kernel(
    ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, cursor_ptr, src_ptr, dst_ptr,
    stride_cs, stride_ch, stride_ck,
    stride_rks, stride_rkl, stride_rkh,
    stride_rus, stride_rul, stride_ruh,
    stride_rgs, stride_rgl,
    GROUP: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pair = tl.program_id(0)
    head = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    n = tl.load(cursor_ptr + src).to(tl.int32)

    offs_k = tl.arange(0, BLOCK_K)
    offs_l = tl.arange(0, BLOCK_L)
    mask_k = offs_k < D_K
    mask_v = offs_v < D_V
    valid = offs_l < n
    rk = tl.load(ring_k_ptr + src * stride_rks + offs_l[:, None] * stride_rkl + (head // GROUP) * stride_rkh
                 + offs_k[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    ru = tl.load(ring_u_ptr + src * stride_rus + offs_l[:, None] * stride_rul + head * stride_ruh
                 + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    ring_g_vec = tl.load(ring_g_ptr + src * stride_rgs + offs_l * stride_rgl + head, mask=valid, other=0.0)
    g_end = tl.sum(tl.where(offs_l == n - 1, ring_g_vec, 0.0))
    w_fold = tl.where(valid, tl.exp(g_end - ring_g_vec), 0.0)

    tile = offs_k[:, None] * stride_ck + offs_v[None, :]
    c_mask = mask_k[:, None] & mask_v[None, :]
    c = tl.load(ckpt_ptr + src * stride_cs + head * stride_ch + tile, mask=c_mask, other=0.0).to(tl.float32)
    folded = _fold_tile(c, rk, ru, w_fold, tl.exp(g_end))
    tl.store(ckpt_ptr + dst * stride_cs + head * stride_ch + tile, folded.to(ckpt_ptr.dtype.element_ty), mask=c_mask)


def _ring_block(L: int) -> int:
    """tl.dot needs every dimension >= 16: short rings are padded with masked rows."""
    return max(16, triton.next_power_of_2(L))


def _check_pools(ckpt, ring_k, ring_u, ring_g, cursor) -> None:
    for name, t in (("ckpt", ckpt), ("ring_k", ring_k), ("ring_u", ring_u), ("ring_g", ring_g), ("cursor", cursor)):
        assert t.is_contiguous(), f"{name} pool must be contiguous"
    assert ring_g.dtype == torch.float32, "ring_g holds cumulative log decays in fp32"


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def replay_decode(q, k, v, a, b, A_log, dt_bias, ckpt, ring_k, ring_u, ring_g, cursor, slots,
                  *, out=None, launch: StepLaunch = DEFAULT_STEP_LAUNCH, **knobs):
    """One ReplaySSM step per sequence (contract: docs/MODULES.md; math: kernels/ref/replay.py).

    q, k [B, H_k, d_k]; v [B, H_v, d_v]; a, b [B, H_v]; slots [B] distinct. Returns o
    [B, H_v, d_v] in q.dtype (`out` may supply it). `launch` (or its fields as keywords:
    block_v, block_k, num_warps, num_stages) tunes the step kernel.
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
    block_dk = max(16, triton.next_power_of_2(d_k))
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
        BLOCK_DK=block_dk, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_L=_ring_block(L),
        NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
    )
    # Must follow the step launch: its fold reads entry 0 of ring_k / ring_g on full rings.
    _replay_append_kernel[(B,)](
        k, a, b, A_log, dt_bias, ring_k, ring_g, cursor, slots,
        k.stride(0), k.stride(1), a.stride(0), b.stride(0),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), ring_g.stride(0), ring_g.stride(1),
        H_K=H_k, H_V=H_v, L=L, D_K=d_k,
        BLOCK_HK=triton.next_power_of_2(H_k), BLOCK_HV=triton.next_power_of_2(H_v), BLOCK_DK=block_dk,
        num_warps=4,
    )
    return o


def replay_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, *, block_v: int | None = None):
    """ckpt[dst] <- state of src at its cursor, rounded to the ckpt dtype. Cursors untouched.

    A pair may fold in place (dst == src), but no dst may be another pair's src: programs run
    in any order, so that would read a half-written checkpoint.
    """
    _check_pools(ckpt, ring_k, ring_u, ring_g, cursor)
    n_pairs = src_slots.numel()
    if n_pairs == 0:
        return
    H_v, d_k, d_v = ckpt.shape[1], ckpt.shape[2], ckpt.shape[3]
    block_v = block_v or min(64, max(16, triton.next_power_of_2(d_v)))
    grid = (n_pairs, H_v, triton.cdiv(d_v, block_v))
    _replay_fold_kernel[grid](
        ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots,
        ckpt.stride(0), ckpt.stride(1), ckpt.stride(2),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        ring_u.stride(0), ring_u.stride(1), ring_u.stride(2),
        ring_g.stride(0), ring_g.stride(1),
        GROUP=H_v // ring_k.shape[2], D_K=d_k, D_V=d_v,
        BLOCK_K=max(16, triton.next_power_of_2(d_k)), BLOCK_V=block_v, BLOCK_L=_ring_block(ring_k.shape[1]),
        num_warps=4,
    )
