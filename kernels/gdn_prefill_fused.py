"""The state pass and the outputs of the chunked GDN prefill in one kernel (kernels/gdn_prefill_kernels.py
has the maths): one program per (d_v block, value head, sequence) carries the fp32 state across
the sequence's chunks and, per chunk with initial state S0, writes the outputs right there:

    u = U − W·S0;   o = (q̂·exp(G))·S0 + causal(q̂·k̂ᵀ · exp(G_i − G_j))·u;
    S ← S0·exp(G_C) + kᵀ·(u ⊙ exp(G_C − G))

The staged path (state pass, then the output kernel) writes every chunk's S0 and u to memory
for the output kernel to read back: per chunk and value head 32 KB of bf16 states and 16 KB of
values, each written once and read once (at 1×32768 tokens, 805 + 403 MB written and read again).
Here they never leave the registers; the price is the chunk's q·kᵀ product, recomputed by each
d_v block's program. None of the output's work feeds the next chunk, so it is off the sequential
path: in the latency-bound case (one long sequence, fewer programs than SMs) it fills the issue
slots the chain leaves idle.

Variants: KEY_PARTS (1, or 2 d_k halves as in kernels/gdn_prefill_state.py); the state is held
untransposed. The tiles of W, k, u, G come from the state pass's loader (`_chunk_tiles`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels._common import L2NORM_EPS
from kernels.gdn_prefill_state import _accumulate, _chunk_tiles, _key_cols, _load_state, _project, _store_state
from kernels.gdn_prefill_tiles import _mm


@triton.jit
def _query_tiles(q_ptr, chunk_start, seq_end, stride_qt, stride_qh, head, D_K, scale,
                 GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr):
    """The chunk's raw q rows as KEY_PARTS [C, d_k / KEY_PARTS] parts, and their row scale
    1/‖q‖ · d_k^-½ ([C] fp32; the reference's L2 normalisation and attention scale)."""
    i = tl.arange(0, C)
    row_ok = chunk_start + i < seq_end
    q_base = q_ptr + chunk_start * stride_qt + (head // GROUP) * stride_qh
    cols, k_ok = _key_cols(0, D_K, BLOCK_K, KEY_PARTS)
    q0 = tl.load(q_base + i[:, None] * stride_qt + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    q0_32 = q0.to(tl.float32)
    sum_sq = tl.sum(q0_32 * q0_32, axis=1)
    if KEY_PARTS == 2:
        cols, k_ok = _key_cols(1, D_K, BLOCK_K, KEY_PARTS)
        q1 = tl.load(q_base + i[:, None] * stride_qt + cols[None, :], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0)
        q1_32 = q1.to(tl.float32)
        sum_sq += tl.sum(q1_32 * q1_32, axis=1)
        q = (q0, q1)
    else:
        q = (q0,)
    return q, tl.rsqrt(sum_sq + L2NORM_EPS) * scale


@triton.jit
def _fused_chunk_step(S, tiles, q, q_scale, chunk_start, seq_end, out_ptr, stride_ot, stride_oh, head, vv, v_ok,
                      C: tl.constexpr, KEY_PARTS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One chunk: its outputs from S0 and u, and the next state. Returns the next state."""
    w, k, u, to_end, decay, G, k_inv_norm = tiles
    # The sequential path first: u = U − W·S0, then the next state; q·S0 rides along (it reads
    # the same S0, which must not outlive the update).
    v_new = u.to(tl.float32) - _project(S, w, KEY_PARTS, False, DOT_DTYPE)  # [C, BV]
    inter = _project(S, q, KEY_PARTS, False, DOT_DTYPE)  # [C, BV]: q·S0 on raw q
    v_to_end = v_new * to_end[:, None]
    if KEY_PARTS == 2:
        S = (_accumulate(S[0], k[0], v_to_end, decay, False, DOT_DTYPE),
             _accumulate(S[1], k[1], v_to_end, decay, False, DOT_DTYPE))
    else:
        S = (_accumulate(S[0], k[0], v_to_end, decay, False, DOT_DTYPE),)

    # The outputs (nothing below feeds the next chunk).
    i = tl.arange(0, C)
    row_ok = chunk_start + i < seq_end
    qk = _mm(q[0], tl.trans(k[0]), DOT_DTYPE)  # [C, C] raw q·kᵀ
    if KEY_PARTS == 2:
        qk += _mm(q[1], tl.trans(k[1]), DOT_DTYPE)
    causal = (i[:, None] >= i[None, :]) & row_ok[:, None]  # missing rows have G = 0: keep exp finite
    decay_ij = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    scores = qk * (q_scale[:, None] * k_inv_norm[None, :]) * decay_ij  # [C, C]
    o = inter * (q_scale * tl.exp(G))[:, None] + _mm(scores, v_new, DOT_DTYPE)  # [C, BV]
    tl.store(out_ptr + (chunk_start + i[:, None]) * stride_ot + head * stride_oh + vv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
    return S


@triton.jit
def _fused_loop_body(S, j, seq_start, seq_end, q_ptr, k_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                     k_inv_norm_ptr, w_ptr, u_ptr, G_ptr, out_ptr, stride_ot, stride_oh, head, vv, v_ok,
                     H_V, H_K, D_K, D_V, scale, GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr,
                     KEY_PARTS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    # A sequence's chunks are consecutive in the tokens: row addresses are arithmetic in the loop
    # index (no table load on the sequential path).
    chunk_start = seq_start + j * C
    tiles = _chunk_tiles(chunk_start, seq_end, k_ptr, stride_kt, stride_kh, k_inv_norm_ptr, w_ptr, u_ptr, G_ptr,
                         head, vv, v_ok, H_V, H_K, D_K, D_V, GROUP, C, BLOCK_K, KEY_PARTS, False)
    q, q_scale = _query_tiles(q_ptr, chunk_start, seq_end, stride_qt, stride_qh, head, D_K, scale, GROUP, C, BLOCK_K,
                              KEY_PARTS)
    return _fused_chunk_step(S, tiles, q, q_scale, chunk_start, seq_end, out_ptr, stride_ot, stride_oh, head, vv,
                             v_ok, C, KEY_PARTS, DOT_DTYPE)


@triton.jit
def state_output_kernel(
    q_ptr, k_ptr, k_inv_norm_ptr, w_ptr, u_ptr, G_ptr, state_ptr, slots_ptr, cu_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_s0, stride_s1, stride_s2, H_V, H_K, scale,
    D_K: tl.constexpr, D_V: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, KEY_PARTS: tl.constexpr, DOT_DTYPE: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    """q, k raw (k_inv_norm [T, H_k] from the WY kernel normalises k); w, u, G from the WY kernel.
    Writes the outputs [T, H_v, d_v] and the final state by slot."""
    # Grid (d_v block, value head, sequence): the programs reading the same q / k / w tiles every
    # chunk run together, so those reads hit L2.
    seq, head = tl.program_id(2), tl.program_id(1)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vv < D_V
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state_base = state_ptr + slot * stride_s0 + head * stride_s1
    S = _load_state(state_base, vv, v_ok, stride_s2, 1, D_K, BLOCK_K, KEY_PARTS, False)
    seq_start = tl.load(cu_ptr + seq).to(tl.int64)
    seq_end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    n_chunks = (seq_end - seq_start + C - 1) // C
    if LOOP_AS_WHILE:
        j = 0
        while j < n_chunks:
            S = _fused_loop_body(S, j, seq_start, seq_end, q_ptr, k_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                                 k_inv_norm_ptr, w_ptr, u_ptr, G_ptr, out_ptr, stride_ot, stride_oh, head, vv, v_ok,
                                 H_V, H_K, D_K, D_V, scale, GROUP, C, BLOCK_K, KEY_PARTS, DOT_DTYPE)
            j += 1
    else:
        for j in range(0, n_chunks):
            S = _fused_loop_body(S, j, seq_start, seq_end, q_ptr, k_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                                 k_inv_norm_ptr, w_ptr, u_ptr, G_ptr, out_ptr, stride_ot, stride_oh, head, vv, v_ok,
                                 H_V, H_K, D_K, D_V, scale, GROUP, C, BLOCK_K, KEY_PARTS, DOT_DTYPE)
    _store_state(state_base, S, vv, v_ok, stride_s2, 1, D_K, BLOCK_K, KEY_PARTS, False)
