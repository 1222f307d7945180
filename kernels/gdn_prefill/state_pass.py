"""The sequential state pass of the chunked GDN prefill: one program per (d_v block, value head,
sequence) carries the fp32 state across the sequence's chunks (kernels/gdn_prefill/__init__.py
has the maths). W and U are never stored: the WY kernel leaves each chunk's M⁻¹·diag(beta) ([C, C],
8 KB in bf16 against 32 KB of W and U rows per chunk and value head at d = 128), and the pass
forms the new values from it with the raw keys and values, since W = M⁻¹ diag(beta·exp(G)/‖k‖) K
and U = M⁻¹ diag(beta) V share their left factor:

    u = U − W·S0 = M⁻¹·diag(beta)·(V − diag(exp(G)/‖k‖)·(K·S0))

Per chunk with initial state S0:

    Q·S0 (saved);   P = K·S0;   u = (M⁻¹·diag(beta))·(V − e ⊙ P) (saved);
    S ← S0·exp(G_C) + kᵀ·(u ⊙ exp(G_C − G)/‖k‖)

That is one product more on the sequential chain than with stored W and U, for far fewer bytes
(W and U are never written and read back), which pays at every shape (docs/BENCHMARKS.md,
"GDN prefill: the inverse form (W and U never stored)").

The output kernel needs S0 only through q·S0, so the pass saves that ([C, d_v] per chunk, raw q)
rather than S0 itself ([d_k, d_v]): half the bytes written and read back, and the output kernel
loses its largest load and product for one product here, off the sequential path
(docs/BENCHMARKS.md, "GDN prefill: the state pass saves q·S0").

Each chunk waits on the previous one: with a few long sequences every program walks a long
chain, one or two programs per SM (prefill.py then runs the table in pieces, the
WY and output kernels of other pieces beside this pass). KEY_PARTS = 2 holds the state as two d_k halves (two
accumulators, two smaller products whose instructions interleave), as fla does; the launch knobs
are `StatePassLaunch` below.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from batchinfer.kernels._common import LOOP_AS_WHILE, TRITON_DTYPES, KernelLaunch, next_pow2_at_least_16
from batchinfer.kernels.gdn_prefill.work import CHUNK, SUB, PrefillWork, _mm, chunk_range


@triton.jit
def _key_cols(part, D_K, BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr):
    cols = part * (BLOCK_K // KEY_PARTS) + tl.arange(0, BLOCK_K // KEY_PARTS)
    return cols, cols < D_K


@triton.jit
def _load_state(base, vv, v_ok, stride_k, D_K, BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr):
    """The state tile [d_k, BV] at base (unit d_v stride) as a tuple of KEY_PARTS fp32 parts [KP, BV]."""
    cols, k_ok = _key_cols(0, D_K, BLOCK_K, KEY_PARTS)
    part0 = tl.load(base + cols[:, None] * stride_k + vv[None, :], mask=k_ok[:, None] & v_ok[None, :],
                    other=0.0).to(tl.float32)
    if KEY_PARTS == 2:
        cols, k_ok = _key_cols(1, D_K, BLOCK_K, KEY_PARTS)
        part1 = tl.load(base + cols[:, None] * stride_k + vv[None, :], mask=k_ok[:, None] & v_ok[None, :],
                        other=0.0).to(tl.float32)
        return part0, part1
    else:
        return (part0,)


@triton.jit
def _store_state(base, S, vv, v_ok, stride_k, D_K, BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr):
    for part in tl.static_range(KEY_PARTS):
        cols, k_ok = _key_cols(part, D_K, BLOCK_K, KEY_PARTS)
        tl.store(base + cols[:, None] * stride_k + vv[None, :], S[part].to(base.dtype.element_ty),
                 mask=k_ok[:, None] & v_ok[None, :])


@triton.jit
def _key_row_parts(base, stride_t, i, row_ok, D_K, BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr):
    """Rows i of a [C, d_k] key (or query) tile at base, raw, as a tuple of KEY_PARTS column parts
    [C, KP]; missing rows and columns load as 0."""
    cols, k_ok = _key_cols(0, D_K, BLOCK_K, KEY_PARTS)
    part0 = tl.load(base + i[:, None] * stride_t + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if KEY_PARTS == 2:
        cols, k_ok = _key_cols(1, D_K, BLOCK_K, KEY_PARTS)
        part1 = tl.load(base + i[:, None] * stride_t + cols[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
        return part0, part1
    else:
        return (part0,)


@triton.jit
def _chunk_tiles(chunk, chunk_start, seq_end, q_ptr, stride_qt, stride_qh, k_ptr, stride_kt, stride_kh, v_ptr,
                 stride_vt, stride_vh, k_inv_norm_ptr, minv_ptr, G_ptr, head, vv, v_ok, H_V, H_K, D_K,
                 GROUP: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
                 KEY_PARTS: tl.constexpr):
    """What chunk `chunk` needs besides the state: (M⁻¹·diag(beta) [C, C], raw q and k parts
    [C, KP], raw v [C, BV], e = exp(G)/‖k‖ [C], to_end = exp(G_C − G)/‖k‖ [C], exp(G_C)). None of it
    depends on the state, so none of it is on the sequential path. Missing rows load q = k = v = 0
    and inverse norm 0, so they add nothing.

    Addresses are a scalar int64 base plus int32 tile offsets: int64 offset tiles would double
    the registers of every [C, d] address tile."""
    i = tl.arange(0, C)
    row_ok = chunk_start + i < seq_end
    # Only the lower blocks are written by the WY kernel; the upper ones load as 0.
    lower = (i[:, None] // SUB) >= (i[None, :] // SUB)
    minv = tl.load(minv_ptr + (chunk.to(tl.int64) * H_V + head) * C * C + i[:, None] * C + i[None, :],
                   mask=lower, other=0.0)  # [C, C]
    q = _key_row_parts(q_ptr + chunk_start * stride_qt + (head // GROUP) * stride_qh, stride_qt, i, row_ok, D_K,
                       BLOCK_K, KEY_PARTS)
    k = _key_row_parts(k_ptr + chunk_start * stride_kt + (head // GROUP) * stride_kh, stride_kt, i, row_ok, D_K,
                       BLOCK_K, KEY_PARTS)
    v = tl.load(v_ptr + chunk_start * stride_vt + head * stride_vh + i[:, None] * stride_vt + vv[None, :],
                mask=row_ok[:, None] & v_ok[None, :], other=0.0)  # [C, BV] raw
    G = tl.load(G_ptr + chunk_start * H_V + head + i * H_V, mask=row_ok, other=0.0)  # [C]
    G_end = tl.load(G_ptr + (tl.minimum(chunk_start + C, seq_end) - 1) * H_V + head,
                    mask=chunk_start < seq_end, other=0.0)  # guarded: an empty sequence has no last row
    inv_norm = tl.load(k_inv_norm_ptr + chunk_start * H_K + head // GROUP + i * H_K, mask=row_ok, other=0.0)
    return minv, q, k, v, tl.exp(G) * inv_norm, tl.exp(G_end - G) * inv_norm, tl.exp(G_end)


@triton.jit
def _chunk_step(S, tiles, chunk_start, seq_end, qs_ptr, vnew_ptr, head, vv, v_ok, H_V, D_V,
                C: tl.constexpr, KEY_PARTS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One chunk: q·S0 (saved); u = M⁻¹·diag(beta)·(V − e ⊙ K·S0) (saved); S ← S0·exp(G_C) + kᵀ·(u ⊙ to_end)."""
    minv, q, k, v, e, to_end, decay = tiles
    i = tl.arange(0, C)
    rows = (chunk_start * H_V + head) * D_V + i[:, None] * (H_V * D_V) + vv[None, :]  # [C, BV] in [T, H_v, d_v]
    rows_ok = (chunk_start + i < seq_end)[:, None] & v_ok[None, :]
    projected = _mm(k[0], S[0], DOT_DTYPE)  # [C, BV]: raw K·S0
    q_projected = _mm(q[0], S[0], DOT_DTYPE)  # [C, BV]: raw Q·S0, off the sequential path
    if KEY_PARTS == 2:
        projected += _mm(k[1], S[1], DOT_DTYPE)
        q_projected += _mm(q[1], S[1], DOT_DTYPE)
    v_new = _mm(minv, v.to(tl.float32) - e[:, None] * projected, DOT_DTYPE)  # [C, BV]
    tl.store(qs_ptr + rows, q_projected.to(qs_ptr.dtype.element_ty), mask=rows_ok)
    tl.store(vnew_ptr + rows, v_new.to(vnew_ptr.dtype.element_ty), mask=rows_ok)
    # Decay and key norms folded into the values rather than the keys (fewer multiplies on the
    # sequential path).
    v_to_end = v_new * to_end[:, None]  # [C, BV]
    if KEY_PARTS == 2:
        return (S[0] * decay + _mm(tl.trans(k[0]), v_to_end, DOT_DTYPE),
                S[1] * decay + _mm(tl.trans(k[1]), v_to_end, DOT_DTYPE))
    else:
        return (S[0] * decay + _mm(tl.trans(k[0]), v_to_end, DOT_DTYPE),)


@triton.jit(do_not_specialize=["chunk_lo", "chunk_hi"])
def state_pass_kernel(
    q_ptr, k_ptr, v_ptr, k_inv_norm_ptr, minv_ptr, G_ptr, state_ptr, slots_ptr, cu_ptr, seq_offsets_ptr,
    chunk_lo, chunk_hi, qs_ptr, vnew_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_s0, stride_s1, stride_s2,
    H_V, H_K,
    D_K: tl.constexpr, D_V: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, KEY_PARTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    """q, k, v raw (k_inv_norm [T, H_k] from the WY kernel normalises k); M⁻¹·diag(beta)
    [N, H_v, C, C] and G from the WY kernel. Writes each chunk's raw q·S0 and new values (both
    [T, H_v, d_v]) and the final state.

    Only the chunks in [chunk_lo, chunk_hi) of the table are walked (a piece of the table: the
    state in the pool carries a sequence from one piece's launch to the next); a sequence with
    none of them returns at once, its state untouched."""
    # Grid (d_v block, value head, sequence): the sibling programs that read the same k tiles
    # every chunk are launched together, so those reads hit L2.
    seq, head = tl.program_id(2), tl.program_id(1)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vv < D_V
    first_chunk = tl.load(seq_offsets_ptr + seq)
    # The sequence's chunks j_lo..j_hi-1 (counted from its first) that lie in the launch's piece.
    j_lo = tl.maximum(first_chunk, chunk_lo) - first_chunk
    j_hi = tl.minimum(tl.load(seq_offsets_ptr + seq + 1), chunk_hi) - first_chunk
    if j_hi <= j_lo:  # nothing of this sequence here (an empty sequence: its state stays as it is)
        return
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state_base = state_ptr + slot * stride_s0 + head * stride_s1
    S = _load_state(state_base, vv, v_ok, stride_s2, D_K, BLOCK_K, KEY_PARTS)

    seq_start = tl.load(cu_ptr + seq).to(tl.int64)
    seq_end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    # A sequence's chunks are consecutive in the table and in the tokens: row addresses are
    # arithmetic in the loop index (no table load on the sequential path).
    if LOOP_AS_WHILE:
        j = j_lo
        while j < j_hi:
            tiles = _chunk_tiles(first_chunk + j, seq_start + j * C, seq_end, q_ptr, stride_qt, stride_qh, k_ptr,
                                 stride_kt, stride_kh, v_ptr, stride_vt, stride_vh, k_inv_norm_ptr, minv_ptr, G_ptr,
                                 head, vv, v_ok, H_V, H_K, D_K, GROUP, C, SUB, BLOCK_K, KEY_PARTS)
            S = _chunk_step(S, tiles, seq_start + j * C, seq_end, qs_ptr, vnew_ptr, head, vv, v_ok, H_V, D_V,
                            C, KEY_PARTS, DOT_DTYPE)
            j += 1
    else:
        for j in range(j_lo, j_hi):
            tiles = _chunk_tiles(first_chunk + j, seq_start + j * C, seq_end, q_ptr, stride_qt, stride_qh, k_ptr,
                                 stride_kt, stride_kh, v_ptr, stride_vt, stride_vh, k_inv_norm_ptr, minv_ptr, G_ptr,
                                 head, vv, v_ok, H_V, H_K, D_K, GROUP, C, SUB, BLOCK_K, KEY_PARTS)
            S = _chunk_step(S, tiles, seq_start + j * C, seq_end, qs_ptr, vnew_ptr, head, vv, v_ok, H_V, D_V,
                            C, KEY_PARTS, DOT_DTYPE)
    _store_state(state_base, S, vv, v_ok, stride_s2, D_K, BLOCK_K, KEY_PARTS)


@dataclass(frozen=True)
class StatePassLaunch(KernelLaunch):
    """The state pass's knobs: KernelLaunch plus key_parts — 1, or 2: the state as two d_k halves
    (d_k < 32 runs in one part). A plain KernelLaunch means one part."""

    key_parts: int = 1

    def __post_init__(self):
        if self.key_parts not in (1, 2):
            raise ValueError(f"key_parts is 1 or 2, not {self.key_parts}")


def as_state_pass_launch(launch: KernelLaunch) -> StatePassLaunch:
    if isinstance(launch, StatePassLaunch):
        return launch
    return StatePassLaunch(launch.block_v, launch.num_warps, launch.num_stages)


def run_state_pass(work: PrefillWork, launch: KernelLaunch, chunks: tuple[int, int] | None = None) -> None:
    """`launch`: a StatePassLaunch, or a plain KernelLaunch (one d_k part). A sequence with no
    chunk in the piece (an empty one, always) keeps its state as it is."""
    T, H_k, d_k, H_v, d_v = work.dims
    launch = as_state_pass_launch(launch)
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    block_k = next_pow2_at_least_16(d_k)
    # Halves narrower than 16 columns cannot be tl.dot operands: small heads run in one part.
    key_parts = launch.key_parts if block_k // launch.key_parts >= 16 else 1
    state = work.state
    lo, hi = chunk_range(work, chunks)
    state_pass_kernel[(triton.cdiv(d_v, block_v), H_v, work.slots.numel())](
        work.q, work.k, work.v, work.k_inv_norm, work.minv, work.G, state, work.slots, work.cu,
        work.chunks.seq_offsets, lo, hi, work.q_states, work.v_new, work.q.stride(0), work.q.stride(1),
        work.k.stride(0), work.k.stride(1), work.v.stride(0), work.v.stride(1),
        state.stride(0), state.stride(1), state.stride(2), H_v, H_k,
        D_K=d_k, D_V=d_v, GROUP=H_v // H_k, C=CHUNK, SUB=SUB, BLOCK_K=block_k, BLOCK_V=block_v,
        KEY_PARTS=key_parts, DOT_DTYPE=TRITON_DTYPES[work.q.dtype], LOOP_AS_WHILE=LOOP_AS_WHILE,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
