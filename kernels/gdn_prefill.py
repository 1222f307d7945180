"""Triton chunked Gated DeltaNet prefill over packed varlen sequences (chunk 64).

Per chunk of C = 64 tokens with cumulative log-decay G (from the chunk start), the C delta-rule
updates collapse into one triangular system (the WY / UT transform):

    M = I + strict_lower(beta_i · k_i·k_j · exp(G_i − G_j))
    W = M⁻¹ (beta · exp(G) · k)          U = M⁻¹ (beta · v)

so that for the chunk's initial state S0 the new values are u = U − W·S0, the outputs are
o = (q·exp(G))·S0 + causal(q·kᵀ · exp(G_i − G_j))·u, and the final state is
S0·exp(G_C) + (k·exp(G_C − G))ᵀ·u. Three launches:

1. `_chunk_wy_kernel`      per (chunk, value head): gates and G, the system, M⁻¹ by 16×16
                           blocks (substitution on the diagonal, products below), then W and U.
2. `_state_pass_kernel`    per (sequence, value head, d_v block): the only sequential part —
                           carries S in fp32 registers across chunks, saves each chunk's S0 and u.
3. `_chunk_output_kernel`  per (chunk, value head, d_v block): the outputs, fully parallel.

Chunks never straddle sequences; a sequence's initial state is read from `state[slot]` and its
final state written back there. q and k are L2-normalised (and q scaled) inside every kernel that
reads them, never materialised. Reference: kernels/ref/gdn.py:gdn_prefill.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import gdn_gate_terms, l2_normalise_rows, next_pow2_at_least_16

CHUNK = 64
SUB = 16  # block size of the triangular inverse
# Launch shapes (d_v block, warps) per kernel, chosen from sm_90 ptxas register/spill reports at
# d_k = d_v = 128 in bf16 (4 warps spill kilobytes in every kernel; 8 warps at most a few hundred bytes).
WY_LAUNCH = (32, 8)
STATE_PASS_LAUNCH = (32, 8)
OUTPUT_LAUNCH = (64, 8)


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b accumulated in fp32, operands in DOT_DTYPE: the input dtype (bf16/fp16 tensor cores),
    or true fp32 ("ieee", not tf32) for fp32 inputs, which is the exact path the tests pin down."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _load_rows(ptr, rows, row_ok, stride_t, head_offset, cols, col_ok):
    """fp32 tile [rows, cols] of one head of a [T, H, d] tensor (rows are token indices)."""
    mask = row_ok[:, None] & col_ok[None, :]
    return tl.load(ptr + rows[:, None] * stride_t + head_offset + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _chunk_rows(chunk_start_ptr, chunk_seq_ptr, cu_ptr, chunk, C: tl.constexpr):
    """Token indices of a chunk's C rows and which of them exist (the last chunk may be short)."""
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    end = tl.load(cu_ptr + tl.load(chunk_seq_ptr + chunk) + 1).to(tl.int64)
    rows = start + tl.arange(0, C)
    return rows, rows < end


@triton.jit
def _load_block(sys_ptr, rows, row_ok, H_V, head, col0, C: tl.constexpr, SUB: tl.constexpr):
    """16×16 block of the [C, C] chunk system stored as rows of C at sys[token, head, :]."""
    cols = col0 + tl.arange(0, SUB)
    return tl.load(sys_ptr + (rows * H_V + head)[:, None] * C + cols[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _invert_diagonal_blocks(sys_ptr, start, n_rows, H_V, head, C: tl.constexpr, SUB: tl.constexpr):
    """(I + A_bb)⁻¹ for the C/SUB strictly lower diagonal blocks A_bb at once, as [C/SUB, SUB, SUB].

    Forward substitution, one row index per step for all blocks together: row i of an inverse is
    e_i − Σ_{j<i} A[i, j]·(row j of the inverse). Substitution (not a Neumann product) keeps it
    backward stable in fp32 even when keys are strongly correlated.
    """
    blk = tl.arange(0, C // SUB)[:, None, None]
    r = tl.arange(0, SUB)[None, :, None]
    c = tl.arange(0, SUB)[None, None, :]
    local = blk * SUB + r
    ptrs = sys_ptr + ((start + local) * H_V + head) * C + blk * SUB + c
    a = tl.load(ptrs, mask=(local < n_rows) & (c < r), other=0.0)  # [C/SUB, SUB, SUB]
    inv = tl.where(r == c, 1.0, 0.0) + tl.zeros((C // SUB, SUB, SUB), dtype=tl.float32)
    for i in range(1, SUB):
        row_i = tl.where(r == i, a, 0.0)  # only row i of each block
        inv = tl.where(r == i, inv - tl.dot(row_i, inv, input_precision="ieee"), inv)
    return inv


@triton.jit
def _store_block(ptr, rows, row_ok, H_V, head, col0, block, C: tl.constexpr, SUB: tl.constexpr):
    cols = col0 + tl.arange(0, SUB)
    tl.store(ptr + (rows * H_V + head)[:, None] * C + cols[None, :], block, mask=row_ok[:, None])


@triton.jit
def _chunk_wy_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, chunk_start_ptr, chunk_seq_ptr, cu_ptr,
    G_ptr, sys_ptr, w_ptr, u_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, H_V, D_K,
    D_V: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    n_rows = tl.load(cu_ptr + tl.load(chunk_seq_ptr + chunk) + 1).to(tl.int64) - start
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
    k = l2_normalise_rows(_load_rows(k_ptr, rows, row_ok, stride_kt, (head // GROUP) * stride_kh, kk, k_ok))
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
    i10 = -tl.dot(x11, tl.dot(a10, x00, input_precision="ieee"), input_precision="ieee")
    i21 = -tl.dot(x22, tl.dot(a21, x11, input_precision="ieee"), input_precision="ieee")
    i32 = -tl.dot(x33, tl.dot(a32, x22, input_precision="ieee"), input_precision="ieee")
    acc20 = tl.dot(a20, x00, input_precision="ieee") + tl.dot(a21, i10, input_precision="ieee")
    i20 = -tl.dot(x22, acc20, input_precision="ieee")
    acc31 = tl.dot(a31, x11, input_precision="ieee") + tl.dot(a32, i21, input_precision="ieee")
    i31 = -tl.dot(x33, acc31, input_precision="ieee")
    acc30 = tl.dot(a30, x00, input_precision="ieee") + tl.dot(a31, i10, input_precision="ieee")
    i30 = -tl.dot(x33, acc30 + tl.dot(a32, i20, input_precision="ieee"), input_precision="ieee")
    _store_block(sys_ptr, rows1, ok1, H_V, head, 0, i10, C, SUB)
    _store_block(sys_ptr, rows2, ok2, H_V, head, 0, i20, C, SUB)
    _store_block(sys_ptr, rows2, ok2, H_V, head, SUB, i21, C, SUB)
    _store_block(sys_ptr, rows3, ok3, H_V, head, 0, i30, C, SUB)
    _store_block(sys_ptr, rows3, ok3, H_V, head, SUB, i31, C, SUB)
    _store_block(sys_ptr, rows3, ok3, H_V, head, 2 * SUB, i32, C, SUB)
    tl.debug_barrier()

    lower_blocks = (i[None, :] // SUB <= i[:, None] // SUB) & row_ok[:, None]
    inverse = tl.load(sys_ptr + (rows * H_V + head)[:, None] * C + i[None, :], mask=lower_blocks, other=0.0)
    w = _mm(inverse, k * (beta * tl.exp(G))[:, None], DOT_DTYPE)  # [C, BK]
    w_tile = w_ptr + (rows * H_V + head)[:, None] * D_K + kk[None, :]
    tl.store(w_tile, w.to(w_ptr.dtype.element_ty), mask=row_ok[:, None] & k_ok[None, :])
    for v0 in tl.static_range(0, D_V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        v_ok = vv < D_V
        v = _load_rows(v_ptr, rows, row_ok, stride_vt, head * stride_vh, vv, v_ok)
        u = _mm(inverse, v * beta[:, None], DOT_DTYPE)  # [C, BV]
        u_tile = u_ptr + (rows * H_V + head)[:, None] * D_V + vv[None, :]
        tl.store(u_tile, u.to(u_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])


@triton.jit
def _load_chunk_operands(
    chunk, valid, k_ptr, w_ptr, u_ptr, G_ptr, chunk_start_ptr, end, head, kk, k_ok, vv, v_ok,
    stride_kt, stride_kh, H_V, D_K, D_V, GROUP: tl.constexpr, C: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """What the state pass reads for one chunk (nothing when not `valid`): rows, W, U, G at the
    chunk's last row, and k·exp(G_end − G) (normalised k, decayed to the chunk end). The two
    matmul operands stay in DOT_DTYPE: they are held in registers across a loop iteration."""
    start = tl.load(chunk_start_ptr + chunk, mask=valid, other=0).to(tl.int64)
    rows = start + tl.arange(0, C)
    row_ok = (rows < end) & valid
    w_tile = w_ptr + (rows * H_V + head)[:, None] * D_K + kk[None, :]
    w = tl.load(w_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)  # [C, BK]
    u = _load_rows(u_ptr, rows, row_ok, H_V * D_V, head * D_V, vv, v_ok)  # [C, BV]
    G = tl.load(G_ptr + rows * H_V + head, mask=row_ok, other=0.0)
    G_end = tl.load(G_ptr + (tl.minimum(start + C, end) - 1) * H_V + head, mask=valid, other=0.0)
    k = l2_normalise_rows(_load_rows(k_ptr, rows, row_ok, stride_kt, (head // GROUP) * stride_kh, kk, k_ok))
    k_to_end = tl.where(row_ok[:, None], k * tl.exp(G_end - G)[:, None], 0.0).to(DOT_DTYPE)  # [C, BK]
    return rows, row_ok, w, u, G_end, k_to_end


@triton.jit
def _state_pass_kernel(
    k_ptr, w_ptr, u_ptr, G_ptr, state_ptr, slots_ptr, cu_ptr, chunk_offsets_ptr, chunk_start_ptr,
    h_ptr, vnew_ptr,
    stride_kt, stride_kh, stride_s0, stride_s1, stride_s2, H_V, D_K, D_V,
    GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < D_K, vv < D_V
    tile_ok = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state_tile = state_ptr + slot * stride_s0 + head * stride_s1 + kk[:, None] * stride_s2 + vv[None, :]
    S = tl.load(state_tile, mask=tile_ok, other=0.0).to(tl.float32)  # [BK, BV]

    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    chunk, last = tl.load(chunk_offsets_ptr + seq), tl.load(chunk_offsets_ptr + seq + 1)
    rows, row_ok, w, u, G_end, k_to_end = _load_chunk_operands(
        chunk, chunk < last, k_ptr, w_ptr, u_ptr, G_ptr, chunk_start_ptr, end, head, kk, k_ok, vv, v_ok,
        stride_kt, stride_kh, H_V, D_K, D_V, GROUP, C, DOT_DTYPE,
    )
    # A while loop because the interpreter cannot range() over loaded bounds; Triton does not
    # software-pipeline while loops, so the next chunk's operands are prefetched by hand: their
    # loads are in flight while this chunk's products run.
    while chunk < last:
        n_rows, n_row_ok, n_w, n_u, n_G_end, n_k_to_end = _load_chunk_operands(
            chunk + 1, chunk + 1 < last, k_ptr, w_ptr, u_ptr, G_ptr, chunk_start_ptr, end, head, kk, k_ok, vv, v_ok,
            stride_kt, stride_kh, H_V, D_K, D_V, GROUP, C, DOT_DTYPE,
        )
        # The chunk's initial state, for the output kernel.
        h_tile = h_ptr + ((chunk.to(tl.int64) * H_V + head) * D_K + kk[:, None]) * D_V + vv[None, :]
        tl.store(h_tile, S.to(h_ptr.dtype.element_ty), mask=tile_ok)
        v_new = u - _mm(w, S, DOT_DTYPE)  # [C, BV]
        vnew_tile = vnew_ptr + (rows * H_V + head)[:, None] * D_V + vv[None, :]
        tl.store(vnew_tile, v_new.to(vnew_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
        S = S * tl.exp(G_end) + _mm(tl.trans(k_to_end), v_new, DOT_DTYPE)
        rows, row_ok, w, u, G_end, k_to_end = n_rows, n_row_ok, n_w, n_u, n_G_end, n_k_to_end
        chunk += 1
    tl.store(state_tile, S.to(state_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, G_ptr, h_ptr, vnew_ptr, out_ptr, chunk_start_ptr, chunk_seq_ptr, cu_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, H_V, D_K, D_V, scale,
    GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    rows, row_ok = _chunk_rows(chunk_start_ptr, chunk_seq_ptr, cu_ptr, chunk, C)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < D_K, vv < D_V
    key_head = head // GROUP
    q = l2_normalise_rows(_load_rows(q_ptr, rows, row_ok, stride_qt, key_head * stride_qh, kk, k_ok)) * scale
    k = l2_normalise_rows(_load_rows(k_ptr, rows, row_ok, stride_kt, key_head * stride_kh, kk, k_ok))
    G = tl.load(G_ptr + rows * H_V + head, mask=row_ok, other=0.0)  # [C]

    h_tile = h_ptr + ((chunk.to(tl.int64) * H_V + head) * D_K + kk[:, None]) * D_V + vv[None, :]
    S0 = tl.load(h_tile, mask=k_ok[:, None] & v_ok[None, :], other=0.0)  # [BK, BV]
    vnew_tile = vnew_ptr + (rows * H_V + head)[:, None] * D_V + vv[None, :]
    v_new = tl.load(vnew_tile, mask=row_ok[:, None] & v_ok[None, :], other=0.0)  # [C, BV]
    i = tl.arange(0, C)
    causal = (i[:, None] >= i[None, :]) & row_ok[:, None]  # missing rows have G = 0: keep exp finite
    decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    scores = _mm(q, tl.trans(k), DOT_DTYPE) * decay  # [C, C]
    o = _mm(q * tl.exp(G)[:, None], S0, DOT_DTYPE) + _mm(scores, v_new, DOT_DTYPE)  # [C, BV]
    out = out_ptr + rows[:, None] * stride_ot + head * stride_oh + vv[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _chunk_layout(cu_seqlens: torch.Tensor):
    """Per-chunk (sequence, first token) and per-sequence chunk offsets; one host sync for the count."""
    cu = cu_seqlens.to(torch.int32)
    lengths = cu[1:] - cu[:-1]  # [B]
    chunks_per_seq = (lengths + CHUNK - 1) // CHUNK
    chunk_offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=cu.device)
    torch.cumsum(chunks_per_seq, 0, out=chunk_offsets[1:])
    num_chunks = int(chunk_offsets[-1])
    seq_ids = torch.arange(lengths.numel(), dtype=torch.int32, device=cu.device)
    chunk_seq = torch.repeat_interleave(seq_ids, chunks_per_seq, output_size=num_chunks).to(torch.int32)
    index_in_seq = torch.arange(num_chunks, dtype=torch.int32, device=cu.device) - chunk_offsets[chunk_seq.long()]
    chunk_start = (cu[chunk_seq.long()] + CHUNK * index_in_seq).to(torch.int32)
    return cu, chunk_offsets, chunk_seq, chunk_start, num_chunks


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens) -> torch.Tensor:
    """Chunked GDN: q, k [T, H_k, d_k]; v [T, H_v, d_v]; a, b [T, H_v]; state [S, H_v, d_k, d_v]
    read and written by `slots` [B]; cu_seqlens [B+1]. Returns o [T, H_v, d_v] in q.dtype."""
    q, k, v, a, b = (_unit_inner(t) for t in (q, k, v, a, b))
    assert state.stride(3) == 1, "state must be contiguous in d_v"
    T, H_k, d_k = k.shape
    H_v, d_v = v.shape[1:]
    out = torch.empty((T, H_v, d_v), dtype=q.dtype, device=q.device)
    num_seqs = slots.numel()
    if num_seqs == 0:
        return out
    cu, chunk_offsets, chunk_seq, chunk_start, num_chunks = _chunk_layout(cu_seqlens)
    # Intermediates (W, U, new values, chunk states) and matmul operands in the input dtype.
    inter = q.dtype
    dot_dtype = _TRITON_DTYPES[q.dtype]
    dev = q.device
    G = torch.empty((T, H_v), dtype=torch.float32, device=dev)
    system = torch.empty((T, H_v, CHUNK), dtype=torch.float32, device=dev)  # scratch: system, then inverse
    w = torch.empty((T, H_v, d_k), dtype=inter, device=dev)
    u = torch.empty((T, H_v, d_v), dtype=inter, device=dev)
    v_new = torch.empty((T, H_v, d_v), dtype=inter, device=dev)
    chunk_states = torch.empty((num_chunks, H_v, d_k, d_v), dtype=inter, device=dev)
    block_k = next_pow2_at_least_16(d_k)
    block_v = lambda launch: min(launch[0], next_pow2_at_least_16(d_v))  # noqa: E731
    group = H_v // H_k

    if num_chunks > 0:
        _chunk_wy_kernel[(num_chunks, H_v)](
            k, v, a, b, A_log, dt_bias, chunk_start, chunk_seq, cu, G, system, w, u,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0), H_v, d_k,
            D_V=d_v, GROUP=group, C=CHUNK, SUB=SUB, BLOCK_K=block_k, BLOCK_V=block_v(WY_LAUNCH), DOT_DTYPE=dot_dtype,
            num_warps=WY_LAUNCH[1],
        )
    # Runs even for empty sequences: their state is read and written back unchanged.
    _state_pass_kernel[(num_seqs, H_v, triton.cdiv(d_v, block_v(STATE_PASS_LAUNCH)))](
        k, w, u, G, state, slots, cu, chunk_offsets, chunk_start, chunk_states, v_new,
        k.stride(0), k.stride(1), state.stride(0), state.stride(1), state.stride(2), H_v, d_k, d_v,
        GROUP=group, C=CHUNK, BLOCK_K=block_k, BLOCK_V=block_v(STATE_PASS_LAUNCH), DOT_DTYPE=dot_dtype,
        num_warps=STATE_PASS_LAUNCH[1],
    )
    if num_chunks > 0:
        _chunk_output_kernel[(num_chunks, H_v, triton.cdiv(d_v, block_v(OUTPUT_LAUNCH)))](
            q, k, G, chunk_states, v_new, out, chunk_start, chunk_seq, cu,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), H_v, d_k, d_v,
            d_k ** -0.5,
            GROUP=group, C=CHUNK, BLOCK_K=block_k, BLOCK_V=block_v(OUTPUT_LAUNCH), DOT_DTYPE=dot_dtype,
            num_warps=OUTPUT_LAUNCH[1],
        )
    return out
