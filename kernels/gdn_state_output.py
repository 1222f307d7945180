"""Fused state pass + chunk outputs of the chunked GDN prefill (replaces run_state_pass + run_output).

The split pipeline writes every chunk's initial state h [N_chunks, H_v, d_k, d_v] (805 MB in bf16
at 1×32768 tokens, 48 heads × 128) and the new values v_new from the sequential state pass, then
reads them back in a parallel output kernel. Here one program per (d_v block, value head,
sequence) carries its S [d_k, BV] block in fp32 registers across the sequence's chunks and, per
chunk with initial state S0 (notation of kernels/gdn_prefill_kernels.py):

    v_new = U − W·S0
    o     = exp(G) ⊙ (q·S0) + (causal(q·kᵀ) ⊙ exp(G_i − G_j))·v_new      → stored to `out`
    S     ← S0·exp(G_C) + kᵀ·(v_new ⊙ exp(G_C − G))

so neither h nor v_new ever reaches memory. q·kᵀ does not depend on S: it is issued first, fed by
the loads alone, off the sequential chain W·S0 → v_new → kᵀ·v_new → S. (Triton waits for each
tensor-core product before the next, so within one program it still adds to the chunk's time; the
overlap comes from the other program resident on the SM.)

The d_v block is the FASTEST grid axis: the sibling programs of one (sequence, head) read the same
W, q and k tiles every chunk, so they must run at the same time to share them in L2 (with the
sequence fastest, as the split state pass had it, they were launched far apart: 43% L2 hits).
Value heads of one key head (h // GROUP) are next in the grid and share q and k as well.

Inputs come from the earlier stages on a planned PrefillWork (kernels/gdn_prefill.py): qn, kn
(normalised, qn scaled), G, W, U. Reference: kernels/ref/gdn.py:gdn_prefill.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels._common import LOOP_AS_WHILE, TRITON_DTYPES, KernelLaunch, next_pow2_at_least_16
from kernels.gdn_prefill import CHUNK, PrefillWork
from kernels.gdn_prefill_kernels import _mm

# Untimed pick until the H200 sweep: at d_k = d_v = 128 (bf16, sm_90) it compiles without spills
# (255 registers, 56 KiB shared: two programs per SM), so at 1×32768 tokens all 48 heads × 4 d_v
# blocks are resident at once. Spill-free too: block_v 32 at 8 warps / 1-2 stages, block_v 16 at
# 4 or 8 warps / 1-2 stages; block_v 64 spills in the loop at every setting.
DEFAULT_STATE_OUTPUT_LAUNCH = KernelLaunch(block_v=32, num_warps=4, num_stages=1)


@triton.jit
def _fused_chunk_step(
    S, chunk_start, seq_end, qn_ptr, kn_ptr, w_ptr, u_ptr, G_ptr, out_ptr, head, kk, k_ok, vv, v_ok, H_V, H_K,
    D_K: tl.constexpr, D_V: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """One chunk: its outputs from S0 = S, and the state at its end (returned, fp32 [BK, BV]).

    Addresses are a scalar int64 base (added to the pointer first) plus int32 tile offsets: int64
    offset tiles would double the registers of every [C, d] address tile (the split state pass
    spilled with them). Rows past the sequence end load as 0 (q, k, W, U) with G = 0, so they
    neither write the state nor reach a stored output.
    """
    i = tl.arange(0, C)
    # Row masks from an int32 count: `chunk_start + i < seq_end` is an int64 compare per row in
    # every layout, and hoisting its loop-invariant part cost ~60 registers (spills).
    n_rows = tl.minimum(seq_end - chunk_start, C).to(tl.int32)
    row_ok = i < n_rows
    kd_mask = row_ok[:, None] & k_ok[None, :]
    vd_mask = row_ok[:, None] & v_ok[None, :]
    key_base = (chunk_start * H_K + head // GROUP) * D_K  # int64 scalar
    key_offsets = i[:, None] * (H_K * D_K) + kk[None, :]  # [C, BK] int32
    q = tl.load(qn_ptr + key_base + key_offsets, mask=kd_mask, other=0.0)  # [C, BK] normalised, scaled
    k = tl.load(kn_ptr + key_base + key_offsets, mask=kd_mask, other=0.0)  # [C, BK] normalised
    w = tl.load(w_ptr + (chunk_start * H_V + head) * D_K + i[:, None] * (H_V * D_K) + kk[None, :],
                mask=kd_mask, other=0.0)  # [C, BK]
    vd_base = (chunk_start * H_V + head) * D_V  # int64 scalar
    vd_offsets = i[:, None] * (H_V * D_V) + vv[None, :]  # [C, BV] int32, shared by U and out
    u = tl.load(u_ptr + vd_base + vd_offsets, mask=vd_mask, other=0.0).to(tl.float32)  # [C, BV]
    G = tl.load(G_ptr + (chunk_start * H_V + head) + i * H_V, mask=row_ok, other=0.0)  # [C]
    G_end = tl.load(G_ptr + (chunk_start + n_rows - 1) * H_V + head)

    # Independent of S: only the loads feed it, so it is not on the chunk-to-chunk chain.
    # The causal mask compares against a per-chunk limit (row i sees j <= i, a missing row sees
    # nothing) rather than being the loop-invariant i >= j: the compiler would hoist that [C, C]
    # mask out of the loop and keep it in registers (it cost spills). The exponent is clamped at
    # 0 (exact for j <= i: G never increases) so that entries j > i cannot overflow before the
    # where drops them.
    last_col = tl.where(row_ok, i, -1)  # [C]
    causal = i[None, :] <= last_col[:, None]  # [C, C]
    decay = tl.exp(tl.minimum(G[:, None] - G[None, :], 0.0))
    scores = tl.where(causal, _mm(q, tl.trans(k), DOT_DTYPE) * decay, 0.0)  # [C, C]

    v_new = u - _mm(w, S, DOT_DTYPE)  # [C, BV]
    # exp(G) scales the [C, BV] product rather than the [C, BK] operand q: fewer multiplies, and q
    # goes to the tensor cores exactly as loaded.
    o = _mm(q, S, DOT_DTYPE) * tl.exp(G)[:, None] + _mm(scores, v_new, DOT_DTYPE)  # [C, BV]
    tl.store(out_ptr + vd_base + vd_offsets, o.to(out_ptr.dtype.element_ty), mask=vd_mask)
    # Decay folded into the [C, BV] values rather than the [C, BK] keys (fewer multiplies on the
    # sequential path).
    v_to_end = v_new * tl.exp(G_end - G)[:, None]
    return S * tl.exp(G_end) + _mm(tl.trans(k), v_to_end, DOT_DTYPE)


@triton.jit
def _state_head(state_ptr, slots_ptr, seq, head, stride_s0, stride_s1):
    """Address of state[slots[seq], head] (scalar, int64 arithmetic)."""
    return state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_s0 + head * stride_s1


@triton.jit
def state_output_kernel(
    qn_ptr, kn_ptr, w_ptr, u_ptr, G_ptr, state_ptr, slots_ptr, cu_ptr, out_ptr,
    stride_s0, stride_s1, stride_s2, H_V, H_K,
    D_K: tl.constexpr, D_V: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    """Grid (d_v block, value head, sequence). An empty sequence reads its state and writes it
    back unchanged (fp32 round trip, exact in the pool's dtype)."""
    v_block, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    vv = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kk < D_K
    # BLOCK_V dividing d_v (the model's case) leaves no tail: a constant mask folds away.
    v_ok = tl.full([BLOCK_V], 1, tl.int1) if D_V % BLOCK_V == 0 else vv < D_V
    tile_ok = k_ok[:, None] & v_ok[None, :]
    state_offsets = kk[:, None] * stride_s2 + vv[None, :]  # [BK, BV] int32
    S = tl.load(_state_head(state_ptr, slots_ptr, seq, head, stride_s0, stride_s1) + state_offsets,
                mask=tile_ok, other=0.0).to(tl.float32)  # [BK, BV]

    seq_start = tl.load(cu_ptr + seq).to(tl.int64)
    seq_end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    n_chunks = ((seq_end - seq_start + C - 1) // C).to(tl.int32)
    # Chunks of a sequence are consecutive tokens: row addresses are arithmetic in the loop index.
    # `for` lets Triton pipeline the per-chunk loads (num_stages); the interpreter needs `while`.
    if LOOP_AS_WHILE:
        j = 0
        while j < n_chunks:
            S = _fused_chunk_step(S, seq_start + j * C, seq_end, qn_ptr, kn_ptr, w_ptr, u_ptr, G_ptr, out_ptr,
                                  head, kk, k_ok, vv, v_ok, H_V, H_K, D_K, D_V, GROUP, C, DOT_DTYPE)
            j += 1
    else:
        for j in range(0, n_chunks):
            S = _fused_chunk_step(S, seq_start + j * C, seq_end, qn_ptr, kn_ptr, w_ptr, u_ptr, G_ptr, out_ptr,
                                  head, kk, k_ok, vv, v_ok, H_V, H_K, D_K, D_V, GROUP, C, DOT_DTYPE)
    # The slot is loaded again rather than the start's address tile kept: that tile (64-bit
    # pointers) would stay live through the loop and spill.
    tl.store(_state_head(state_ptr, slots_ptr, seq, head, stride_s0, stride_s1) + state_offsets,
             S.to(state_ptr.dtype.element_ty), mask=tile_ok)


def run_state_output(work: PrefillWork, launch: KernelLaunch = DEFAULT_STATE_OUTPUT_LAUNCH) -> None:
    """Fills work.out and writes each sequence's final state to state[slots]; needs qn, kn, G, W, U
    (run_l2norm, run_wy). Runs even when there are no tokens: empty sequences keep their state.
    Neither work.chunk_states nor work.v_new is touched."""
    T, H_k, d_k, H_v, d_v = work.dims
    num_seqs = work.slots.numel()
    if num_seqs == 0:
        return
    # out is addressed with U's offsets (one address tile for both): both contiguous [T, H_v, d_v].
    assert work.out.is_contiguous() and work.u.is_contiguous() and work.out.shape == work.u.shape
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    state = work.state
    state_output_kernel[(triton.cdiv(d_v, block_v), H_v, num_seqs)](
        work.qn, work.kn, work.w, work.u, work.G, state, work.slots, work.cu, work.out,
        state.stride(0), state.stride(1), state.stride(2), H_v, H_k,
        D_K=d_k, D_V=d_v, GROUP=H_v // H_k, C=CHUNK, BLOCK_K=next_pow2_at_least_16(d_k), BLOCK_V=block_v,
        DOT_DTYPE=TRITON_DTYPES[work.q.dtype], LOOP_AS_WHILE=LOOP_AS_WHILE,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
