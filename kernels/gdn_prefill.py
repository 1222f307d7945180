"""Triton chunked Gated DeltaNet prefill over packed varlen sequences (chunk 64).

Per chunk of C = 64 tokens with cumulative log-decay G (from the chunk start), the C delta-rule
updates collapse into one triangular system (the WY / UT transform):

    M = I + strict_lower(beta_i · k_i·k_j · exp(G_i − G_j))
    W = M⁻¹ (beta · exp(G) · k)          U = M⁻¹ (beta · v)

so that for the chunk's initial state S0 the new values are u = U − W·S0, the outputs are
o = (q·exp(G))·S0 + causal(q·kᵀ · exp(G_i − G_j))·u, and the final state is
S0·exp(G_C) + kᵀ·(u · exp(G_C − G)). Four launches:

0. `_l2norm_qk_kernel`     q, k L2-normalised once (q also scaled), in the input dtype.
1. `_chunk_wy_kernel`      per (chunk, value head): gates and G, the system, M⁻¹ by 16×16
                           blocks (substitution on the diagonal, products below), then W and U.
2. `_state_pass_kernel`    per (sequence, value head, d_v block): the only sequential part —
                           carries S in fp32 registers across chunks, saves each chunk's S0 and u.
3. `_chunk_output_kernel`  per (chunk, value head, d_v block): the outputs, fully parallel.

Chunks never straddle sequences; a sequence's initial state is read from `state[slot]` and its
final state written back there. No host sync: the chunk grid is sized from shapes
(kernels/_common.py:ChunkTable). Launch knobs per kernel: `PrefillLaunch`.
Reference: kernels/ref/gdn.py:gdn_prefill.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels._common import (
    LOOP_AS_WHILE, TRITON_DTYPES, ChunkTable, KernelLaunch, chunk_table, gdn_gate_terms, l2_normalise_rows,
    next_pow2_at_least_16,
)

CHUNK = 64
SUB = 16  # block size of the triangular inverse
NORM_ROWS = 16  # tokens per program of the q/k normalisation


@dataclass(frozen=True)
class PrefillLaunch:
    """Knobs per kernel (block_v = d_v block; for `wy` the d_v step of its U loop).

    Stages share no block_v-dependent buffer or grid: every intermediate is allocated at full d_v
    (plan_prefill) and each launch sizes its own grid, so any mix of per-stage knobs is valid
    (tests/test_kernels_gdn.py: MIXED_LAUNCHES). Defaults are the combination whose end-to-end
    run on the H200 was fastest AND known good (1×32768: 8.2 ms vs 10.8 ms for the first
    defaults; docs/BENCHMARKS.md, 2026-11-29). WY at 4 warps was 2.6× faster at 8×2048 but sat
    in the one combination that hit an illegal memory access, so it waits for a clean run.
    """

    wy: KernelLaunch = field(default_factory=lambda: KernelLaunch(block_v=64, num_warps=8, num_stages=1))
    state_pass: KernelLaunch = field(default_factory=lambda: KernelLaunch(block_v=32, num_warps=4, num_stages=2))
    output: KernelLaunch = field(default_factory=lambda: KernelLaunch(block_v=64, num_warps=4, num_stages=2))


DEFAULT_LAUNCH = PrefillLaunch()


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b accumulated in fp32, operands in DOT_DTYPE: the input dtype (bf16/fp16 tensor cores),
    or true fp32 ("ieee", not tf32) for fp32 inputs, which is the exact path the tests pin down."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _l2norm_qk_kernel(
    q_ptr, k_ptr, qn_ptr, kn_ptr, T, H_K, D_K, stride_qt, stride_qh, stride_kt, stride_kh, scale,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]
    head = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    ok = (tok < T)[:, None] & (kk < D_K)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    out = (tok64 * H_K + head) * D_K + kk[None, :]  # normalised tensors are contiguous [T, H_k, d_k]
    q = tl.load(q_ptr + tok64 * stride_qt + head * stride_qh + kk[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(qn_ptr + out, (l2_normalise_rows(q) * scale).to(qn_ptr.dtype.element_ty), mask=ok)
    k = tl.load(k_ptr + tok64 * stride_kt + head * stride_kh + kk[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(kn_ptr + out, l2_normalise_rows(k).to(kn_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _load_block(sys_ptr, rows, row_ok, H_V, head, col0, C: tl.constexpr, SUB: tl.constexpr):
    """16×16 block of the [C, C] chunk system stored as rows of C at sys[token, head, :]."""
    cols = col0 + tl.arange(0, SUB)
    return tl.load(sys_ptr + (rows * H_V + head)[:, None] * C + cols[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _invert_diagonal_blocks(sys_ptr, start, n_rows, H_V, head, C: tl.constexpr, SUB: tl.constexpr):
    """(I + A_bb)⁻¹ for the C/SUB strictly lower diagonal blocks A_bb at once, as [C/SUB, SUB, SUB].

    Forward substitution, one row index per step for all blocks together: row i of an inverse is
    e_i − Σ_{j<i} A[i, j]·(row j of the inverse), as broadcast-and-reduce (no matmul: a 16-wide
    fp32 product is too small for tensor cores). Substitution (not a Neumann product) keeps it
    backward stable in fp32 even when keys are strongly correlated.
    """
    blk = tl.arange(0, C // SUB)[:, None, None]
    r = tl.arange(0, SUB)[None, :, None]
    c = tl.arange(0, SUB)[None, None, :]
    local = blk * SUB + r
    ptrs = sys_ptr + ((start + local) * H_V + head) * C + blk * SUB + c
    a = tl.load(ptrs, mask=(local < n_rows) & (c < r), other=0.0)  # [C/SUB, SUB, SUB]
    inv = tl.where(r == c, 1.0, 0.0) + tl.zeros((C // SUB, SUB, SUB), dtype=tl.float32)
    for i in tl.static_range(1, SUB):
        coeffs = tl.sum(tl.where(r == i, a, 0.0), axis=1)  # [C/SUB, SUB]: row i of each A_bb
        correction = tl.sum(coeffs[:, :, None] * inv, axis=1)  # [C/SUB, SUB]: Σ_j A[i, j]·inv[j, :]
        inv = tl.where(r == i, inv - correction[:, None, :], inv)
    return inv


@triton.jit
def _store_block(ptr, rows, row_ok, H_V, head, col0, block, C: tl.constexpr, SUB: tl.constexpr):
    cols = col0 + tl.arange(0, SUB)
    tl.store(ptr + (rows * H_V + head)[:, None] * C + cols[None, :], block, mask=row_ok[:, None])


@triton.jit
def _chunk_wy_kernel(
    kn_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, chunk_start_ptr, chunk_end_ptr,
    G_ptr, sys_ptr, w_ptr, u_ptr,
    stride_vt, stride_vh, stride_at, stride_bt, H_V, H_K, D_K,
    D_V: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr, INV_PRECISION: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    n_rows = tl.load(chunk_end_ptr + chunk).to(tl.int64) - start
    if n_rows <= 0:  # an unused tail chunk of the table
        return
    i = tl.arange(0, C)
    rows, row_ok = start + i, i < n_rows

    # Gates and the cumulative log-decay G from the chunk start (kept for the later kernels).
    g, beta = gdn_gate_terms(
        tl.load(a_ptr + rows * stride_at + head, mask=row_ok, other=0.0).to(tl.float32),
        tl.load(b_ptr + rows * stride_bt + head, mask=row_ok, other=0.0).to(tl.float32),
        tl.load(A_log_ptr + head).to(tl.float32),
        tl.load(dt_bias_ptr + head).to(tl.float32),
    )
    g, beta = tl.where(row_ok, g, 0.0), tl.where(row_ok, beta, 0.0)  # missing rows: no decay, no write
    G = tl.cumsum(g, axis=0)  # [C]
    tl.store(G_ptr + rows * H_V + head, G, mask=row_ok)

    # The strict-lower system, staged through scratch memory: the inverse works on 16×16 blocks,
    # and a register tile cannot be sliced.
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < D_K
    k_tile = kn_ptr + (rows * H_K + head // GROUP)[:, None] * D_K + kk[None, :]
    k = tl.load(k_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [C, BK] normalised, input dtype
    below = i[:, None] > i[None, :]
    decay = tl.exp(tl.where(below, G[:, None] - G[None, :], float("-inf")))  # [C, C], 0 on/above diagonal
    system = beta[:, None] * _mm(k, tl.trans(k), DOT_DTYPE) * decay
    tl.store(sys_ptr + (rows * H_V + head)[:, None] * C + i[None, :], system, mask=row_ok[:, None])
    tl.debug_barrier()

    r = tl.arange(0, SUB)
    rows0, rows1, rows2, rows3 = start + r, start + SUB + r, start + 2 * SUB + r, start + 3 * SUB + r
    ok0, ok1, ok2, ok3 = r < n_rows, SUB + r < n_rows, 2 * SUB + r < n_rows, 3 * SUB + r < n_rows
    # M⁻¹ of the block lower-triangular M: diagonal blocks X_bb by substitution, then block row i
    # of the inverse as −X_ii · Σ_{j≤m<i} A_im · Inv_mj. Off-diagonal A blocks are read before
    # anything is overwritten; the inverse replaces the system in place (barriers between).
    # INV_PRECISION is tf32 for 16-bit inputs (the inverse is rounded to 16 bits right after).
    a10 = _load_block(sys_ptr, rows1, ok1, H_V, head, 0, C, SUB)
    a20 = _load_block(sys_ptr, rows2, ok2, H_V, head, 0, C, SUB)
    a21 = _load_block(sys_ptr, rows2, ok2, H_V, head, SUB, C, SUB)
    a30 = _load_block(sys_ptr, rows3, ok3, H_V, head, 0, C, SUB)
    a31 = _load_block(sys_ptr, rows3, ok3, H_V, head, SUB, C, SUB)
    a32 = _load_block(sys_ptr, rows3, ok3, H_V, head, 2 * SUB, C, SUB)
    diagonal = _invert_diagonal_blocks(sys_ptr, start, n_rows, H_V, head, C, SUB)  # [4, SUB, SUB]
    tl.debug_barrier()
    blk = tl.arange(0, C // SUB)[:, None, None]
    local = blk * SUB + r[None, :, None]
    tl.store(
        sys_ptr + ((start + local) * H_V + head) * C + blk * SUB + r[None, None, :], diagonal, mask=local < n_rows
    )
    tl.debug_barrier()
    x00 = _load_block(sys_ptr, rows0, ok0, H_V, head, 0, C, SUB)
    x11 = _load_block(sys_ptr, rows1, ok1, H_V, head, SUB, C, SUB)
    x22 = _load_block(sys_ptr, rows2, ok2, H_V, head, 2 * SUB, C, SUB)
    x33 = _load_block(sys_ptr, rows3, ok3, H_V, head, 3 * SUB, C, SUB)
    i10 = -tl.dot(x11, tl.dot(a10, x00, input_precision=INV_PRECISION), input_precision=INV_PRECISION)
    i21 = -tl.dot(x22, tl.dot(a21, x11, input_precision=INV_PRECISION), input_precision=INV_PRECISION)
    i32 = -tl.dot(x33, tl.dot(a32, x22, input_precision=INV_PRECISION), input_precision=INV_PRECISION)
    acc20 = tl.dot(a20, x00, input_precision=INV_PRECISION) + tl.dot(a21, i10, input_precision=INV_PRECISION)
    i20 = -tl.dot(x22, acc20, input_precision=INV_PRECISION)
    acc31 = tl.dot(a31, x11, input_precision=INV_PRECISION) + tl.dot(a32, i21, input_precision=INV_PRECISION)
    i31 = -tl.dot(x33, acc31, input_precision=INV_PRECISION)
    acc30 = tl.dot(a30, x00, input_precision=INV_PRECISION) + tl.dot(a31, i10, input_precision=INV_PRECISION)
    i30 = -tl.dot(x33, acc30 + tl.dot(a32, i20, input_precision=INV_PRECISION), input_precision=INV_PRECISION)
    _store_block(sys_ptr, rows1, ok1, H_V, head, 0, i10, C, SUB)
    _store_block(sys_ptr, rows2, ok2, H_V, head, 0, i20, C, SUB)
    _store_block(sys_ptr, rows2, ok2, H_V, head, SUB, i21, C, SUB)
    _store_block(sys_ptr, rows3, ok3, H_V, head, 0, i30, C, SUB)
    _store_block(sys_ptr, rows3, ok3, H_V, head, SUB, i31, C, SUB)
    _store_block(sys_ptr, rows3, ok3, H_V, head, 2 * SUB, i32, C, SUB)
    tl.debug_barrier()

    lower_blocks = (i[None, :] // SUB <= i[:, None] // SUB) & row_ok[:, None]
    inverse = tl.load(sys_ptr + (rows * H_V + head)[:, None] * C + i[None, :], mask=lower_blocks, other=0.0)
    w = _mm(inverse, k.to(tl.float32) * (beta * tl.exp(G))[:, None], DOT_DTYPE)  # [C, BK]
    w_tile = w_ptr + (rows * H_V + head)[:, None] * D_K + kk[None, :]
    tl.store(w_tile, w.to(w_ptr.dtype.element_ty), mask=row_ok[:, None] & k_ok[None, :])
    for v0 in tl.static_range(0, D_V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        v_ok = vv < D_V
        v_mask = row_ok[:, None] & v_ok[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_vt + head * stride_vh + vv[None, :], mask=v_mask, other=0.0)
        u = _mm(inverse, v.to(tl.float32) * beta[:, None], DOT_DTYPE)  # [C, BV]
        tl.store(u_ptr + (rows * H_V + head)[:, None] * D_V + vv[None, :], u.to(u_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _state_chunk_step(
    S, chunk, chunk_start, kn_ptr, w_ptr, u_ptr, G_ptr, h_ptr, vnew_ptr, seq_end, head, kk, k_ok, vv, v_ok,
    H_V, H_K, D_K, D_V, GROUP: tl.constexpr, C: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """One chunk of the state pass: save S0, u = U − W·S0, S ← S0·exp(G_C) + kᵀ·(u·exp(G_C − G)).

    Addresses are a scalar int64 base plus int32 tile offsets: int64 offset tiles would double
    the registers of every [C, d] address tile (the pass ran at 255 registers with spills)."""
    i = tl.arange(0, C)
    row_ok = chunk_start + i < seq_end
    kd_mask = row_ok[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + (chunk_start * H_V + head) * D_K + i[:, None] * (H_V * D_K) + kk[None, :],
                mask=kd_mask, other=0.0)  # [C, BK]
    k = tl.load(kn_ptr + (chunk_start * H_K + head // GROUP) * D_K + i[:, None] * (H_K * D_K) + kk[None, :],
                mask=kd_mask, other=0.0)  # [C, BK] normalised
    vd_mask = row_ok[:, None] & v_ok[None, :]
    vd_base = (chunk_start * H_V + head) * D_V
    vd_offsets = i[:, None] * (H_V * D_V) + vv[None, :]
    u = tl.load(u_ptr + vd_base + vd_offsets, mask=vd_mask, other=0.0).to(tl.float32)  # [C, BV]
    G = tl.load(G_ptr + (chunk_start + i) * H_V + head, mask=row_ok, other=0.0)  # [C]
    G_end = tl.load(G_ptr + (tl.minimum(chunk_start + C, seq_end) - 1) * H_V + head)

    h_base = h_ptr + (chunk.to(tl.int64) * H_V + head) * D_K * D_V
    tl.store(h_base + kk[:, None] * D_V + vv[None, :], S.to(h_ptr.dtype.element_ty), mask=k_ok[:, None] & v_ok[None, :])
    v_new = u - _mm(w, S, DOT_DTYPE)  # [C, BV]
    tl.store(vnew_ptr + vd_base + vd_offsets, v_new.to(vnew_ptr.dtype.element_ty), mask=vd_mask)
    # Decay folded into the [C, BV] values rather than the [C, BK] keys (fewer multiplies on the
    # sequential path); missing rows have k = 0.
    v_to_end = v_new * tl.exp(G_end - G)[:, None]
    return S * tl.exp(G_end) + _mm(tl.trans(k), v_to_end, DOT_DTYPE)


@triton.jit
def _state_pass_kernel(
    kn_ptr, w_ptr, u_ptr, G_ptr, state_ptr, slots_ptr, cu_ptr, seq_offsets_ptr, h_ptr, vnew_ptr,
    stride_s0, stride_s1, stride_s2, H_V, H_K, D_K: tl.constexpr, D_V: tl.constexpr,
    GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < D_K, vv < D_V
    tile_ok = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state_tile = state_ptr + slot * stride_s0 + head * stride_s1 + kk[:, None] * stride_s2 + vv[None, :]
    S = tl.load(state_tile, mask=tile_ok, other=0.0).to(tl.float32)  # [BK, BV]

    seq_start = tl.load(cu_ptr + seq).to(tl.int64)
    seq_end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    first_chunk = tl.load(seq_offsets_ptr + seq)
    n_chunks = tl.load(seq_offsets_ptr + seq + 1) - first_chunk
    # A sequence's chunks are consecutive in the table and in the tokens: row addresses are
    # arithmetic in the loop index (no table load on the sequential path).
    if LOOP_AS_WHILE:
        j = 0
        while j < n_chunks:
            S = _state_chunk_step(S, first_chunk + j, seq_start + j * C, kn_ptr, w_ptr, u_ptr, G_ptr, h_ptr,
                                  vnew_ptr, seq_end, head, kk, k_ok, vv, v_ok, H_V, H_K, D_K, D_V, GROUP, C, DOT_DTYPE)
            j += 1
    else:
        for j in range(0, n_chunks):
            S = _state_chunk_step(S, first_chunk + j, seq_start + j * C, kn_ptr, w_ptr, u_ptr, G_ptr, h_ptr,
                                  vnew_ptr, seq_end, head, kk, k_ok, vv, v_ok, H_V, H_K, D_K, D_V, GROUP, C, DOT_DTYPE)
    tl.store(state_tile, S.to(state_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _chunk_output_kernel(
    qn_ptr, kn_ptr, G_ptr, h_ptr, vnew_ptr, out_ptr, chunk_start_ptr, chunk_end_ptr,
    stride_ot, stride_oh, H_V, H_K, D_K, D_V,
    GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    n_rows = tl.load(chunk_end_ptr + chunk).to(tl.int64) - start
    if n_rows <= 0:  # an unused tail chunk of the table
        return
    i = tl.arange(0, C)
    rows, row_ok = start + i, i < n_rows
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < D_K, vv < D_V
    qk_tile = (rows * H_K + head // GROUP)[:, None] * D_K + kk[None, :]
    qk_mask = row_ok[:, None] & k_ok[None, :]
    q = tl.load(qn_ptr + qk_tile, mask=qk_mask, other=0.0)  # [C, BK] normalised and scaled
    k = tl.load(kn_ptr + qk_tile, mask=qk_mask, other=0.0)  # [C, BK]
    G = tl.load(G_ptr + rows * H_V + head, mask=row_ok, other=0.0)  # [C]
    h_tile = h_ptr + ((chunk.to(tl.int64) * H_V + head) * D_K + kk[:, None]) * D_V + vv[None, :]
    S0 = tl.load(h_tile, mask=k_ok[:, None] & v_ok[None, :], other=0.0)  # [BK, BV]
    vnew_tile = vnew_ptr + (rows * H_V + head)[:, None] * D_V + vv[None, :]
    v_new = tl.load(vnew_tile, mask=row_ok[:, None] & v_ok[None, :], other=0.0)  # [C, BV]

    causal = (i[:, None] >= i[None, :]) & row_ok[:, None]  # missing rows have G = 0: keep exp finite
    decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    scores = _mm(q, tl.trans(k), DOT_DTYPE) * decay  # [C, C]
    o = _mm(q.to(tl.float32) * tl.exp(G)[:, None], S0, DOT_DTYPE) + _mm(scores, v_new, DOT_DTYPE)  # [C, BV]
    out = out_ptr + rows[:, None] * stride_ot + head * stride_oh + vv[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass(frozen=True)
class PrefillWork:
    """Inputs, chunk table and intermediates of one prefill call; each stage reads and writes these.

    Intermediates and matmul operands are in the input dtype (bf16 on the GPU), G and the
    triangular system in fp32.
    """

    q: torch.Tensor  # [T, H_k, d_k] raw
    k: torch.Tensor  # [T, H_k, d_k] raw
    v: torch.Tensor  # [T, H_v, d_v]
    a: torch.Tensor  # [T, H_v]
    b: torch.Tensor  # [T, H_v]
    A_log: torch.Tensor  # [H_v]
    dt_bias: torch.Tensor  # [H_v]
    state: torch.Tensor  # [S, H_v, d_k, d_v]
    slots: torch.Tensor  # [B]
    cu: torch.Tensor  # [B+1] int32
    chunks: ChunkTable
    qn: torch.Tensor  # [T, H_k, d_k] normalised, scaled
    kn: torch.Tensor  # [T, H_k, d_k] normalised
    G: torch.Tensor  # [T, H_v] fp32 cumulative log-decay within each chunk
    system: torch.Tensor  # [T, H_v, C] fp32 scratch: the system, then its inverse
    w: torch.Tensor  # [T, H_v, d_k]
    u: torch.Tensor  # [T, H_v, d_v]
    v_new: torch.Tensor  # [T, H_v, d_v]
    chunk_states: torch.Tensor  # [N, H_v, d_k, d_v]
    out: torch.Tensor  # [T, H_v, d_v]

    @property
    def dims(self):
        T, H_k, d_k = self.k.shape
        return T, H_k, d_k, self.v.shape[1], self.v.shape[2]


def plan_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens) -> PrefillWork:
    q, k, v, a, b = (_unit_inner(t) for t in (q, k, v, a, b))
    assert state.stride(3) == 1, "state must be contiguous in d_v"
    T, H_k, d_k = k.shape
    H_v, d_v = v.shape[1:]
    chunks = chunk_table(cu_seqlens, CHUNK, T)
    dev, inter = q.device, q.dtype
    return PrefillWork(
        q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, slots=slots,
        cu=cu_seqlens.to(torch.int32), chunks=chunks,
        qn=torch.empty((T, H_k, d_k), dtype=inter, device=dev),
        kn=torch.empty((T, H_k, d_k), dtype=inter, device=dev),
        G=torch.empty((T, H_v), dtype=torch.float32, device=dev),
        system=torch.empty((T, H_v, CHUNK), dtype=torch.float32, device=dev),
        w=torch.empty((T, H_v, d_k), dtype=inter, device=dev),
        u=torch.empty((T, H_v, d_v), dtype=inter, device=dev),
        v_new=torch.empty((T, H_v, d_v), dtype=inter, device=dev),
        chunk_states=torch.empty((chunks.capacity, H_v, d_k, d_v), dtype=inter, device=dev),
        out=torch.empty((T, H_v, d_v), dtype=q.dtype, device=dev),
    )


def run_l2norm(work: PrefillWork) -> None:
    T, H_k, d_k, _, _ = work.dims
    _l2norm_qk_kernel[(triton.cdiv(T, NORM_ROWS), H_k)](
        work.q, work.k, work.qn, work.kn, T, H_k, d_k,
        work.q.stride(0), work.q.stride(1), work.k.stride(0), work.k.stride(1), d_k ** -0.5,
        ROWS=NORM_ROWS, BLOCK_K=next_pow2_at_least_16(d_k), num_warps=4,
    )


def run_wy(work: PrefillWork, launch: KernelLaunch) -> None:
    T, H_k, d_k, H_v, d_v = work.dims
    dot_dtype = TRITON_DTYPES[work.q.dtype]
    _chunk_wy_kernel[(work.chunks.capacity, H_v)](
        work.kn, work.v, work.a, work.b, work.A_log, work.dt_bias, work.chunks.start, work.chunks.seq_end,
        work.G, work.system, work.w, work.u,
        work.v.stride(0), work.v.stride(1), work.a.stride(0), work.b.stride(0), H_v, H_k, d_k,
        D_V=d_v, GROUP=H_v // H_k, C=CHUNK, SUB=SUB, BLOCK_K=next_pow2_at_least_16(d_k),
        BLOCK_V=min(launch.block_v, next_pow2_at_least_16(d_v)), DOT_DTYPE=dot_dtype,
        INV_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


def run_state_pass(work: PrefillWork, launch: KernelLaunch) -> None:
    """Runs even for empty sequences: their state is read and written back unchanged."""
    T, H_k, d_k, H_v, d_v = work.dims
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    state = work.state
    _state_pass_kernel[(work.slots.numel(), H_v, triton.cdiv(d_v, block_v))](
        work.kn, work.w, work.u, work.G, state, work.slots, work.cu, work.chunks.seq_offsets,
        work.chunk_states, work.v_new,
        state.stride(0), state.stride(1), state.stride(2), H_v, H_k,
        D_K=d_k, D_V=d_v, GROUP=H_v // H_k, C=CHUNK, BLOCK_K=next_pow2_at_least_16(d_k), BLOCK_V=block_v,
        DOT_DTYPE=TRITON_DTYPES[work.q.dtype], LOOP_AS_WHILE=LOOP_AS_WHILE,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


def run_output(work: PrefillWork, launch: KernelLaunch) -> None:
    T, H_k, d_k, H_v, d_v = work.dims
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    _chunk_output_kernel[(work.chunks.capacity, H_v, triton.cdiv(d_v, block_v))](
        work.qn, work.kn, work.G, work.chunk_states, work.v_new, work.out, work.chunks.start, work.chunks.seq_end,
        work.out.stride(0), work.out.stride(1), H_v, H_k, d_k, d_v,
        GROUP=H_v // H_k, C=CHUNK, BLOCK_K=next_pow2_at_least_16(d_k), BLOCK_V=block_v,
        DOT_DTYPE=TRITON_DTYPES[work.q.dtype], num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens,
                launch: PrefillLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """Chunked GDN: q, k [T, H_k, d_k]; v [T, H_v, d_v]; a, b [T, H_v]; state [S, H_v, d_k, d_v]
    read and written by `slots` [B]; cu_seqlens [B+1]. Returns o [T, H_v, d_v] in q.dtype."""
    work = plan_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens)
    if slots.numel() == 0:
        return work.out
    if work.chunks.capacity > 0 and q.shape[0] > 0:
        run_l2norm(work)
        run_wy(work, launch.wy)
    run_state_pass(work, launch.state_pass)
    if work.chunks.capacity > 0 and q.shape[0] > 0:
        run_output(work, launch.output)
    return work.out
