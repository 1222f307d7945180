"""The ReplaySSM decode step: `replay_decode` runs the flush (flush.py), the ring-key dots
(key_dots.py) and the step kernel below, which computes u and o from the state snapshot and the ring
and appends the new entry (the package docstring has how the launches divide the work)."""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from batchinfer.kernels._common import gdn_gate_terms
from batchinfer.kernels.replay_ssm.dots import _mma, _mma_fp32_operand
from batchinfer.kernels.replay_ssm.flush import flush_full_rings
from batchinfer.kernels.replay_ssm.fold import _launch_fold
from batchinfer.kernels.replay_ssm.key_dots import _launch_key_dots
from batchinfer.kernels.replay_ssm.launch import DEFAULT_STEP_LAUNCH, StepLaunch, check_pools, ring_block, row_major


@triton.jit
def _gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, seq, stride_ab, stride_bb, heads):
    """g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b) for `heads` of one sequence."""
    a = tl.load(a_ptr + seq * stride_ab + heads).to(tl.float32)
    b = tl.load(b_ptr + seq * stride_bb + heads).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads).to(tl.float32)
    A_log = tl.load(A_log_ptr + heads).to(tl.float32)
    return gdn_gate_terms(a, b, A_log, dt_bias)  # the same math as the GDN kernels, one definition


@triton.jit
def _kq_columns(k_row_ptr, q_row_ptr, offs_k, mask_k, OP_DTYPE: tl.constexpr, LOW: tl.constexpr):
    """[BK, 2] mma operand: column 0 raw k, column 1 raw q over the d_k chunk offs_k.

    LOW: what the OP_DTYPE rounding of the (wider) inputs dropped, so that dots with the high
    and the low operand, summed, keep ~16 mantissa bits.
    """
    cols = tl.arange(0, 2)[None, :]
    x = tl.load(tl.where(cols == 0, k_row_ptr, q_row_ptr) + offs_k[:, None],
                mask=mask_k[:, None], other=0.0).to(tl.float32)
    if LOW:
        x = x - x.to(OP_DTYPE).to(tl.float32)
    return x.to(OP_DTYPE)


@triton.jit
def _dk_dots_mma(c_base, rk_base, k_row_ptr, q_row_ptr, stride_ck, offs_v, mask_v, in_ring,
                 D_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr,
                 NUM_STAGES: tl.constexpr, SPLIT: tl.constexpr, RING_KEYS: tl.constexpr):
    """Raw (unscaled) [Cᵀk, Cᵀq] [BV, 2] and, if RING_KEYS, [rk·k, rk·q] [BL, 2] on tensor cores.

    The mma pads N = 2 to its 8 columns; the results need no reduction (columns split in-thread).
    """
    acc_c = tl.zeros([BLOCK_V, 2], tl.float32)
    acc_r = tl.zeros([BLOCK_L, 2], tl.float32)
    for k0 in tl.range(0, D_K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D_K
        # Loaded as the transposed tile (not tl.trans of a [BK, BV] load): that keeps it a
        # cp.async into shared memory (ptxas/PTX, sm_90: ~2.5x fewer instructions per chunk).
        c_t = tl.load(c_base + offs_k[None, :] * stride_ck + offs_v[:, None],
                      mask=mask_v[:, None] & mask_k[None, :], other=0.0)  # Cᵀ chunk  [BV, BK]
        kq = _kq_columns(k_row_ptr, q_row_ptr, offs_k, mask_k, c_t.dtype, False)  # [BK, 2]
        acc_c = _mma(c_t, kq, acc_c)
        if RING_KEYS:
            rk = tl.load(rk_base + offs_k[None, :], mask=in_ring[:, None] & mask_k[None, :],
                         other=0.0)  # [BL, BK], stale rows included (an mma keeps them in their row)
            acc_r = _mma(rk, kq, acc_r)
        if SPLIT:
            kq_low = _kq_columns(k_row_ptr, q_row_ptr, offs_k, mask_k, c_t.dtype, True)
            acc_c = _mma(c_t, kq_low, acc_c)
            if RING_KEYS:
                acc_r = _mma(rk, kq_low, acc_r)
    return acc_c, acc_r


@triton.jit
def _dk_dots_fma(c_base, rk_base, k_row_ptr, q_row_ptr, stride_ck, offs_v, mask_v, in_ring,
                 D_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr,
                 NUM_STAGES: tl.constexpr, RING_KEYS: tl.constexpr):
    """_dk_dots_mma's results by broadcast-multiply + tl.sum in fp32 (CUDA cores)."""
    c_dot_k = tl.zeros([BLOCK_V], tl.float32)
    c_dot_q = tl.zeros([BLOCK_V], tl.float32)
    rk_dot_k = tl.zeros([BLOCK_L], tl.float32)
    rk_dot_q = tl.zeros([BLOCK_L], tl.float32)
    for k0 in tl.range(0, D_K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D_K
        c = tl.load(c_base + offs_k[:, None] * stride_ck + offs_v[None, :],
                    mask=mask_k[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # [BK, BV]
        k = tl.load(k_row_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BK]
        q = tl.load(q_row_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BK]
        c_dot_k += tl.sum(c * k[:, None], 0)
        c_dot_q += tl.sum(c * q[:, None], 0)
        if RING_KEYS:
            rk = tl.load(rk_base + offs_k[None, :], mask=in_ring[:, None] & mask_k[None, :],
                         other=0.0).to(tl.float32)  # [BL, BK], stale rows included
            rk_dot_k += tl.sum(rk * k[None, :], 1)
            rk_dot_q += tl.sum(rk * q[None, :], 1)
    return tl.join(c_dot_k, c_dot_q), tl.join(rk_dot_k, rk_dot_q)


@triton.jit
def replay_step_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, cursor_ptr, slots_ptr, key_dots_ptr, o_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_ab, stride_bb, stride_ob, stride_oh,
    stride_cs, stride_ch, stride_ck,
    stride_rks, stride_rkl, stride_rkh,
    stride_rus, stride_rul, stride_ruh,
    stride_rgs, stride_rgl,
    scale,
    GROUP: tl.constexpr, L: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr,
    NUM_STAGES: tl.constexpr, TENSOR_CORES: tl.constexpr, SPLIT: tl.constexpr,
    KEY_DOTS_GIVEN: tl.constexpr, LIVE_RING_LOADS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    H_K = tl.num_programs(1) // GROUP
    key_head = head // GROUP
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < D_V
    offs_l = tl.arange(0, BLOCK_L)
    in_ring = offs_l < L  # a constant mask: no load below waits for the cursor
    offs_dk = tl.arange(0, BLOCK_DK)
    mask_dk = offs_dk < D_K
    k_row_ptr = k_ptr + seq * stride_kb + key_head * stride_kh
    q_row_ptr = q_ptr + seq * stride_qb + key_head * stride_qh

    # The new token's inputs do not depend on the slot: issued first.
    q_all = tl.load(q_row_ptr + offs_dk, mask=mask_dk, other=0.0)
    k_all = tl.load(k_row_ptr + offs_dk, mask=mask_dk, other=0.0)
    v = tl.load(v_ptr + seq * stride_vb + head * stride_vh + offs_v, mask=mask_v, other=0.0)
    g, beta = _gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, seq, stride_ab, stride_bb, head)
    if KEY_DOTS_GIVEN:  # [B, H_k, BL, 2] raw [rk·k, rk·q] from the flush launch (stale entries included)
        rk_dots = tl.load(key_dots_ptr + ((seq * H_K + key_head) * BLOCK_L + offs_l[:, None]) * 2
                          + tl.arange(0, 2)[None, :])

    # Everything slot-dependent is issued together, one round trip after `slot`.
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    n_stored = tl.load(cursor_ptr + slot).to(tl.int32)
    if LIVE_RING_LOADS:
        # Only the live entries move from memory (half the ring on average), at the price of the
        # ring loads waiting for the cursor (the snapshot's, the bulk, do not).
        ring_rows = offs_l < tl.where(n_stored == L, 0, n_stored)
    else:
        ring_rows = in_ring
    ring_g_vec = tl.load(ring_g_ptr + slot * stride_rgs + offs_l * stride_rgl + head,
                         mask=ring_rows, other=0.0)  # cumulative log decays  [BL]
    ru = tl.load(ring_u_ptr + slot * stride_rus + offs_l[:, None] * stride_rul + head * stride_ruh
                 + offs_v[None, :], mask=ring_rows[:, None] & mask_v[None, :], other=0.0)  # [BL, BV]
    c_base = ckpt_ptr + slot * stride_cs + head * stride_ch
    rk_base = ring_k_ptr + slot * stride_rks + offs_l[:, None] * stride_rkl + key_head * stride_rkh

    q_all = q_all.to(tl.float32)
    k_all = k_all.to(tl.float32)
    q_scale = tl.rsqrt(tl.sum(q_all * q_all) + 1e-6) * scale
    k_scale = tl.rsqrt(tl.sum(k_all * k_all) + 1e-6)
    k_dot_q = tl.sum(k_all * q_all) * (q_scale * k_scale)

    # Raw dot products over d_k chunks; column 0 against k, column 1 against q (q/k scales
    # applied once at the end).
    if TENSOR_CORES:
        c_dots, rk_dots_here = _dk_dots_mma(
            c_base, rk_base, k_row_ptr, q_row_ptr, stride_ck, offs_v, mask_v, ring_rows,
            D_K, BLOCK_K, BLOCK_V, BLOCK_L, NUM_STAGES, SPLIT, not KEY_DOTS_GIVEN)  # [BV, 2], [BL, 2]
    else:
        c_dots, rk_dots_here = _dk_dots_fma(
            c_base, rk_base, k_row_ptr, q_row_ptr, stride_ck, offs_v, mask_v, ring_rows,
            D_K, BLOCK_K, BLOCK_V, BLOCK_L, NUM_STAGES, not KEY_DOTS_GIVEN)
    if not KEY_DOTS_GIVEN:
        rk_dots = rk_dots_here

    # Validity in registers. A full ring was folded by the flush launch: it restarts empty.
    n = tl.where(n_stored == L, 0, n_stored)
    live = offs_l < n  # entries of S_n; stale ones may hold NaN, so select, never multiply
    g_new = tl.sum(tl.where(offs_l == n - 1, ring_g_vec, 0.0)) + g  # G_{n+1} = G_n + g (G_0 = 0)
    w = tl.exp(g_new - ring_g_vec)  # exp(G_{n+1} − G_i)  [BL]
    qk_scale = tl.where(tl.arange(0, 2) == 0, k_scale, q_scale)  # [2]
    coef = tl.where(live[:, None], rk_dots * w[:, None] * qk_scale[None, :], 0.0)  # [BL, 2]
    ru = tl.where(live[:, None], ru, 0.0).to(ring_u_ptr.dtype.element_ty)  # [BL, BV]
    decay = tl.exp(g_new)
    # (exp(g)·S_n)ᵀ [k q] = decay · Cᵀ[k q] + Σ_i coef_i u_i  [BV, 2]
    ring_dots = _mma_fp32_operand(tl.trans(ru), coef, tl.zeros([BLOCK_V, 2], tl.float32))  # Σ_i coef_i u_i
    state_dots = c_dots * (decay * qk_scale)[None, :] + ring_dots
    decayed_s_k, decayed_s_q = tl.split(state_dots)  # [BV] each
    u = beta * (v.to(tl.float32) - decayed_s_k)  # [BV]
    o = decayed_s_q + k_dot_q * u  # S_{n+1}ᵀ q = (exp(g)·S_n)ᵀ q + u (k·q)  [BV]
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)

    # Append entry n: each part written by exactly one program.
    tl.store(ring_u_ptr + slot * stride_rus + n * stride_rul + head * stride_ruh + offs_v,
             u.to(ring_u_ptr.dtype.element_ty), mask=mask_v)
    tl.store(ring_g_ptr + slot * stride_rgs + n * stride_rgl + head, g_new, mask=v_block == 0)
    writes_key = (v_block == 0) & (head % GROUP == 0)
    tl.store(ring_k_ptr + slot * stride_rks + n * stride_rkl + key_head * stride_rkh + offs_dk,
             (k_all * k_scale).to(ring_k_ptr.dtype.element_ty), mask=mask_dk & writes_key)


def replay_decode(q, k, v, a, b, A_log, dt_bias, ckpt, ring_k, ring_u, ring_g, cursor, slots,
                  *, out=None, launch: StepLaunch = DEFAULT_STEP_LAUNCH, **knobs):
    """One ReplaySSM step per sequence (contract: docs/MODULES.md; math: kernels/ref/replay.py).

    q, k [B, H_k, d_k]; v [B, H_v, d_v]; a, b [B, H_v]; slots [B] distinct. Returns o
    [B, H_v, d_v] in q.dtype (`out` may supply it). `launch` (or its fields as keywords)
    tunes the launches (module docstring).
    """
    check_pools(ckpt, ring_k, ring_u, ring_g, cursor)
    if knobs:  # keyword overrides (benchmarks/tests); the model's per-layer call builds nothing
        launch = replace(launch, **knobs)
    B, H_k, d_k = k.shape
    H_v, d_v = v.shape[1], v.shape[2]
    L = ring_k.shape[1]
    assert q.dtype == k.dtype, "q and k share a dtype (one mma operand)"
    q, k, v, a, b = (row_major(t) for t in (q, k, v, a, b))
    o = torch.empty((B, H_v, d_v), dtype=q.dtype, device=q.device) if out is None else out
    if B == 0:
        return o
    block_l = ring_block(L) if launch.tensor_cores or launch.key_dots_in_flush else triton.next_power_of_2(L)
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
