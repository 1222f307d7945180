"""The ReplaySSM Triton kernels — the decode step, the fold (flush / copy) — and their tile
helpers. Launch knobs, host-side launchers and how the two launches divide the work:
kernels/replay_ssm.py; the maths and the ring layout: kernels/ref/replay.py."""
from __future__ import annotations

import os

import triton
import triton.language as tl

from kernels._common import gdn_gate_terms

# Triton 3.6's interpreter (the CPU tests) gets 16-bit tl.dot wrong; there the operands are
# widened to fp32, which computes the same products exactly (16-bit products fit in fp32).
WIDEN_DOTS = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

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
def _mma(a, b, acc):
    """acc + a @ b, fp32 accumulation: 16-bit operands on tensor cores, fp32 ones in true fp32."""
    if WIDEN_DOTS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _mma_fp32_operand(a, b, acc):
    """acc + a @ b where a or b is fp32 and the other may be 16-bit.

    Against a 16-bit operand the fp32 one goes in as its high and low parts in that dtype (two
    mma's): ~16 mantissa bits instead of 8, products exact, sums in fp32.
    """
    if a.dtype == b.dtype:
        acc = _mma(a, b, acc)
    elif a.dtype == tl.float32:
        high = a.to(b.dtype)
        acc = _mma((a - high.to(tl.float32)).to(b.dtype), b, _mma(high, b, acc))
    else:
        high = b.to(a.dtype)
        acc = _mma(a, (b - high.to(tl.float32)).to(a.dtype), _mma(a, high, acc))
    return acc


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
        # ring loads waiting for the cursor (the checkpoint's, the bulk, do not).
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


@triton.jit
def _fold_tile(ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, src, dst, n, head, key_head, v_block,
               stride_cs, stride_ch, stride_ck, stride_rks, stride_rkl, stride_rkh, stride_rus, stride_rul,
               stride_ruh, stride_rgs, stride_rgl,
               D_K: tl.constexpr, D_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_L: tl.constexpr, FOLD_K: tl.constexpr):
    """ckpt[dst] <- exp(G_n)·C[src] + Σ_{i<n} exp(G_n − G_i) k_i ⊗ u_i on one (value head, d_v
    block) tile, in chunks of FOLD_K d_k rows."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < D_V
    valid = offs_l < n
    ring_g_vec = tl.load(ring_g_ptr + src * stride_rgs + offs_l * stride_rgl + head, mask=valid, other=0.0)
    ru = tl.load(ring_u_ptr + src * stride_rus + offs_l[:, None] * stride_rul + head * stride_ruh
                 + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0)  # [BL, BV]
    g_end = tl.sum(tl.where(offs_l == n - 1, ring_g_vec, 0.0))
    w = tl.where(valid, tl.exp(g_end - ring_g_vec), 0.0)  # in [0, 1]: G only decreases  [BL]
    # d_k rows are independent: chunks of FOLD_K rows bound the registers, which every
    # program of the launch reserves, the many that exit at once included (fewer registers,
    # more programs resident per SM, fewer waves of early exits).
    for k0 in tl.range(0, BLOCK_K, FOLD_K):
        rows = k0 + tl.arange(0, FOLD_K)
        rows_in = rows < D_K
        rk_t = tl.load(ring_k_ptr + src * stride_rks + offs_l[None, :] * stride_rkl + key_head * stride_rkh
                       + rows[:, None], mask=rows_in[:, None] & valid[None, :], other=0.0)  # [FK, BL]
        tile = rows[:, None] * stride_ck + offs_v[None, :]
        c_mask = rows_in[:, None] & mask_v[None, :]
        c = tl.load(ckpt_ptr + src * stride_cs + head * stride_ch + tile, mask=c_mask, other=0.0)
        weighted_k_t = rk_t.to(tl.float32) * w[None, :]  # [FK, BL]
        ring = _mma_fp32_operand(weighted_k_t, ru, tl.zeros([FOLD_K, BLOCK_V], tl.float32))  # [FK, BV]
        folded = tl.exp(g_end) * c.to(tl.float32) + ring
        tl.store(ckpt_ptr + dst * stride_cs + head * stride_ch + tile,
                 folded.to(ckpt_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _write_key_dots(ring_k_ptr, q_ptr, k_ptr, key_dots_ptr, src, pair, key_head, num_key_heads, rows,
                    stride_rks, stride_rkl, stride_rkh, stride_qb, stride_qh, stride_kb, stride_kh,
                    D_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr):
    """The raw dots ring_k[i]·k and ring_k[i]·q of one (sequence, key head) for the entries i <
    rows (all L, stale ones included, or the live ones; the step masks the others: 0 here)."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_l = tl.arange(0, BLOCK_L)
    mask_k = offs_k < D_K
    in_ring = offs_l < rows
    rk = tl.load(ring_k_ptr + src * stride_rks + offs_l[:, None] * stride_rkl
                 + key_head * stride_rkh + offs_k[None, :],
                 mask=in_ring[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BL, BK]
    k = tl.load(k_ptr + pair * stride_kb + key_head * stride_kh + offs_k, mask=mask_k, other=0.0)
    q = tl.load(q_ptr + pair * stride_qb + key_head * stride_qh + offs_k, mask=mask_k, other=0.0)
    dots = tl.join(tl.sum(rk * k.to(tl.float32)[None, :], 1), tl.sum(rk * q.to(tl.float32)[None, :], 1))
    row = (pair * num_key_heads + key_head) * BLOCK_L + offs_l  # [BL]
    tl.store(key_dots_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :], dots)  # [BL, 2]


@triton.jit
def replay_fold_kernel(
    ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, cursor_ptr, src_ptr, dst_ptr,
    q_ptr, k_ptr, key_dots_ptr,
    stride_cs, stride_ch, stride_ck,
    stride_rks, stride_rkl, stride_rkh,
    stride_rus, stride_rul, stride_ruh,
    stride_rgs, stride_rgl,
    stride_qb, stride_qh, stride_kb, stride_kh,
    GROUP: tl.constexpr, L: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr, FULL_ONLY: tl.constexpr,
    FOLD_K: tl.constexpr, KEY_DOTS: tl.constexpr, PER_KEY_HEAD: tl.constexpr,
):
    """ckpt[dst] <- exp(G_n)·C[src] + Σ_{i<n} exp(G_n − G_i) k_i ⊗ u_i (`_fold_tile`).

    Grid (pair, value head, d_v block); with PER_KEY_HEAD (pair, key head, 1): one program folds
    the GROUP value heads × every d_v block of its key head in turn — 12× fewer programs, most
    of which only read the cursor and exit (or write the key dots).
    FULL_ONLY (the step's flush): pairs whose ring is not full do not fold. KEY_DOTS (flush
    only, src == dst == the step's slots): one program per (sequence, key head) whose ring is
    not full writes the raw dots ring_k[i]·k and ring_k[i]·q of all L entries for the step.
    """
    pair = tl.program_id(0)
    src = tl.load(src_ptr + pair).to(tl.int64)
    n = tl.load(cursor_ptr + src).to(tl.int32)
    if PER_KEY_HEAD:
        key_head = tl.program_id(1)
        num_key_heads = tl.num_programs(1)
        head0 = key_head * GROUP
        v_block = 0
    else:
        head0 = tl.program_id(1)
        key_head = head0 // GROUP
        num_key_heads = tl.num_programs(1) // GROUP
        v_block = tl.program_id(2)
    if FULL_ONLY:
        active = n == L
    else:
        active = n >= 0
    if active:
        dst = tl.load(dst_ptr + pair).to(tl.int64)
        if PER_KEY_HEAD:
            for i in tl.range(0, GROUP * tl.cdiv(D_V, BLOCK_V)):
                _fold_tile(ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, src, dst, n,
                           head0 + i % GROUP, key_head, i // GROUP,
                           stride_cs, stride_ch, stride_ck, stride_rks, stride_rkl, stride_rkh, stride_rus,
                           stride_rul, stride_ruh, stride_rgs, stride_rgl,
                           D_K, D_V, BLOCK_K, BLOCK_V, BLOCK_L, FOLD_K)
        else:
            _fold_tile(ckpt_ptr, ring_k_ptr, ring_u_ptr, ring_g_ptr, src, dst, n, head0, key_head, v_block,
                       stride_cs, stride_ch, stride_ck, stride_rks, stride_rkl, stride_rkh, stride_rus,
                       stride_rul, stride_ruh, stride_rgs, stride_rgl,
                       D_K, D_V, BLOCK_K, BLOCK_V, BLOCK_L, FOLD_K)
    if KEY_DOTS:
        if (n != L) & (v_block == 0) & (head0 % GROUP == 0):
            _write_key_dots(ring_k_ptr, q_ptr, k_ptr, key_dots_ptr, src, pair, key_head, num_key_heads, L,
                            stride_rks, stride_rkl, stride_rkh, stride_qb, stride_qh, stride_kb, stride_kh,
                            D_K, BLOCK_K, BLOCK_L)


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


@triton.jit
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
    """Persistent grid (P,): fold every full ring (cursor == L) among `slots` into its checkpoint.

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
