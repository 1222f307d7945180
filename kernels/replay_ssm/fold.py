"""The fold: a slot's state snapshot with its n pending ring entries folded in, written to another
slot (`replay_fold`: copy) or in place (flush). Maths and ring layout: kernels/ref/replay.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels.replay_ssm.dots import _mma_fp32_operand
from batchinfer.kernels.replay_ssm.launch import check_pools, ring_block


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
        BLOCK_K=block_dk, BLOCK_V=block_v, BLOCK_L=ring_block(ring_k.shape[1]),
        FULL_ONLY=full_only, FOLD_K=fold_k, KEY_DOTS=with_dots, PER_KEY_HEAD=per_key_head, num_warps=num_warps,
    )


def replay_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, *, block_v: int = 32,
                block_k: int = 16, num_warps: int = 1):
    """ckpt[dst] <- state of src at its cursor, rounded to the ckpt dtype. Cursors untouched.

    A pair may fold in place (dst == src), but no dst may be another pair's src: programs run
    in any order, so that would read a half-written state snapshot.
    """
    check_pools(ckpt, ring_k, ring_u, ring_g, cursor)
    if src_slots.numel() == 0:
        return
    _launch_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots, full_only=False,
                 block_v=block_v, block_k=block_k, num_warps=num_warps)
