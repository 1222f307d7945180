"""Triton kernels of the chunked Gated DeltaNet prefill (chunk C = 64); kernels/gdn_prefill.py
plans the scratch buffers and launches them.

Per chunk with cumulative log-decay G (from the chunk start), the C delta-rule updates
collapse into one triangular system (the WY / UT transform):

    M = I + strict_lower(beta_i · k_i·k_j · exp(G_i − G_j))
    W = M⁻¹ (beta · exp(G) · k)          U = M⁻¹ (beta · v)

so that for the chunk's initial state S0 the new values are u = U − W·S0, the outputs are
o = (q·exp(G))·S0 + causal(q·kᵀ · exp(G_i − G_j))·u, and the final state is
S0·exp(G_C) + kᵀ·(u · exp(G_C − G)). One kernel per stage, in launch order:

0. `l2norm_qk_kernel`     q, k L2-normalised once (q also scaled), in the input dtype.
1. `chunk_wy_kernel`      per (chunk, value head): gates and G, the system, M⁻¹ by 16×16
                          blocks (substitution on the diagonal, products below), then W and U.
2. `state_pass_kernel`    per (sequence, value head, d_v block): the only sequential part —
                          carries S in fp32 registers across chunks, saves each chunk's S0 and u.
3. `chunk_output_kernel`  per (chunk, value head, d_v block): the outputs, fully parallel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels._common import gdn_gate_terms, l2_normalise_rows


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b accumulated in fp32, operands in DOT_DTYPE: the input dtype (bf16/fp16 tensor cores),
    or true fp32 ("ieee", not tf32) for fp32 inputs, which is the exact path the tests pin down."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _chunk_rows(chunk_start_ptr, chunk_end_ptr, chunk, C: tl.constexpr):
    """Chunk `chunk` of the table: first token, row count (≤ 0 for an unused tail chunk), and
    its C local row indices, token rows and row mask."""
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    n_rows = tl.load(chunk_end_ptr + chunk).to(tl.int64) - start
    i = tl.arange(0, C)
    return start, n_rows, i, start + i, i < n_rows


@triton.jit
def l2norm_qk_kernel(
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
def chunk_wy_kernel(
    kn_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, chunk_start_ptr, chunk_end_ptr,
    G_ptr, sys_ptr, w_ptr, u_ptr,
    stride_vt, stride_vh, stride_at, stride_bt, H_V, H_K, D_K,
    D_V: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr, INV_PRECISION: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, n_rows, i, rows, row_ok = _chunk_rows(chunk_start_ptr, chunk_end_ptr, chunk, C)
    if n_rows <= 0:  # an unused tail chunk of the table
        return

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
def state_pass_kernel(
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
def chunk_output_kernel(
    qn_ptr, kn_ptr, G_ptr, h_ptr, vnew_ptr, out_ptr, chunk_start_ptr, chunk_end_ptr,
    stride_ot, stride_oh, H_V, H_K, D_K, D_V,
    GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, n_rows, i, rows, row_ok = _chunk_rows(chunk_start_ptr, chunk_end_ptr, chunk, C)
    if n_rows <= 0:  # an unused tail chunk of the table
        return
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
