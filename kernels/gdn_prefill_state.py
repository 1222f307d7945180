"""The sequential state pass of the chunked GDN prefill: one program per (d_v block, value head,
sequence) carries the fp32 state across the sequence's chunks (kernels/gdn_prefill_kernels.py has
the maths). Per chunk with initial state S0:

    save S0 (the output kernel reads it);   u = U − W·S0 (saved);
    S ← S0·exp(G_C) + kᵀ·(u ⊙ exp(G_C − G))

The pass is latency-bound (one program per SM at most for a long sequence: each chunk waits on
the previous one), so its variants trade registers for a shorter dependent chain per chunk; all
are selected by constexprs that kernels/gdn_prefill.py:StatePassLaunch sets:

- TRANSPOSED: hold Sᵀ [BV, d_k] instead of S [d_k, BV]. Both products then take the state side
  as their LEFT operand (u = U − (Sᵀ·Wᵀ)ᵀ, Sᵀ += (u·decay)ᵀ·k), which the tensor cores read from
  registers; the right operands (W, k) come straight from the pipelined loads. Untransposed, the
  state and the new values are right operands and go through shared memory every chunk.
- KEY_PARTS = 2: the state as two d_k halves (two accumulators, two smaller products whose
  instructions interleave), as fla does.
- PREFETCH: the next chunk's w, k, u, G are loaded into registers at the top of the current
  chunk, so their latency hides behind a whole chunk of work (Triton's own pipelining, num_stages,
  issues the next loads after the current chunk's products and waits for them at once).

Every layout stores the chunk states in the same [N, H_v, d_k, d_v] layout.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.gdn_prefill_tiles import _mm


@triton.jit
def _state_offsets(key_cols, vv, stride_k, stride_v, TRANSPOSED: tl.constexpr):
    """Offsets of one d_k part of a state tile: [KP, BV], or [BV, KP] when TRANSPOSED."""
    if TRANSPOSED:
        return vv[:, None] * stride_v + key_cols[None, :] * stride_k
    else:
        return key_cols[:, None] * stride_k + vv[None, :] * stride_v


@triton.jit
def _state_mask(k_ok, v_ok, TRANSPOSED: tl.constexpr):
    if TRANSPOSED:
        return v_ok[:, None] & k_ok[None, :]
    else:
        return k_ok[:, None] & v_ok[None, :]


@triton.jit
def _key_cols(part, D_K, BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr):
    cols = part * (BLOCK_K // KEY_PARTS) + tl.arange(0, BLOCK_K // KEY_PARTS)
    return cols, cols < D_K


@triton.jit
def _load_state(base, vv, v_ok, stride_k, stride_v, D_K,
                BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The state tile as a tuple of KEY_PARTS fp32 parts."""
    cols, k_ok = _key_cols(0, D_K, BLOCK_K, KEY_PARTS)
    part0 = tl.load(base + _state_offsets(cols, vv, stride_k, stride_v, TRANSPOSED),
                    mask=_state_mask(k_ok, v_ok, TRANSPOSED), other=0.0).to(tl.float32)
    if KEY_PARTS == 2:
        cols, k_ok = _key_cols(1, D_K, BLOCK_K, KEY_PARTS)
        part1 = tl.load(base + _state_offsets(cols, vv, stride_k, stride_v, TRANSPOSED),
                        mask=_state_mask(k_ok, v_ok, TRANSPOSED), other=0.0).to(tl.float32)
        return part0, part1
    else:
        return (part0,)


@triton.jit
def _store_state(base, S, vv, v_ok, stride_k, stride_v, D_K,
                 BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr, TRANSPOSED: tl.constexpr):
    for part in tl.static_range(KEY_PARTS):
        cols, k_ok = _key_cols(part, D_K, BLOCK_K, KEY_PARTS)
        tl.store(base + _state_offsets(cols, vv, stride_k, stride_v, TRANSPOSED), S[part].to(base.dtype.element_ty),
                 mask=_state_mask(k_ok, v_ok, TRANSPOSED))


@triton.jit
def _value_tile(i, vv, row_ok, v_ok, row_stride, TRANSPOSED: tl.constexpr):
    """Offsets and mask of a chunk's [C, BV] value tile (u, new values), [BV, C] when TRANSPOSED."""
    if TRANSPOSED:
        return i[None, :] * row_stride + vv[:, None], row_ok[None, :] & v_ok[:, None]
    else:
        return i[:, None] * row_stride + vv[None, :], row_ok[:, None] & v_ok[None, :]


@triton.jit
def _chunk_tiles(chunk_start, seq_end, k_ptr, stride_kt, stride_kh, k_inv_norm_ptr, w_ptr, u_ptr, G_ptr, head,
                 vv, v_ok, H_V, H_K, D_K, D_V, GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr,
                 KEY_PARTS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """What one chunk needs besides the state: (w parts, raw k parts, u, to_end [C], decay) with
    to_end = exp(G_C − G)/‖k‖ (the decay to the chunk end and the key normalisation, folded into
    the values' rows) and decay = exp(G_C). All of it is independent of the state, so none of it
    is on the sequential path. A chunk past the sequence end loads nothing (every row masked) and
    is never used.

    Addresses are a scalar int64 base plus int32 tile offsets: int64 offset tiles would double
    the registers of every [C, d] address tile (the pass ran at 255 registers with spills)."""
    i = tl.arange(0, C)
    row_ok = chunk_start + i < seq_end
    w_base = w_ptr + (chunk_start * H_V + head) * D_K
    k_base = k_ptr + chunk_start * stride_kt + (head // GROUP) * stride_kh
    cols, k_ok = _key_cols(0, D_K, BLOCK_K, KEY_PARTS)
    mask = row_ok[:, None] & k_ok[None, :]
    w0 = tl.load(w_base + i[:, None] * (H_V * D_K) + cols[None, :], mask=mask, other=0.0)  # [C, KP]
    k0 = tl.load(k_base + i[:, None] * stride_kt + cols[None, :], mask=mask, other=0.0)  # [C, KP] raw
    if KEY_PARTS == 2:
        cols, k_ok = _key_cols(1, D_K, BLOCK_K, KEY_PARTS)
        mask = row_ok[:, None] & k_ok[None, :]
        w1 = tl.load(w_base + i[:, None] * (H_V * D_K) + cols[None, :], mask=mask, other=0.0)
        k1 = tl.load(k_base + i[:, None] * stride_kt + cols[None, :], mask=mask, other=0.0)
        w, k = (w0, w1), (k0, k1)
    else:
        w, k = (w0,), (k0,)
    offsets, mask = _value_tile(i, vv, row_ok, v_ok, H_V * D_V, TRANSPOSED)
    u = tl.load(u_ptr + (chunk_start * H_V + head) * D_V + offsets, mask=mask, other=0.0)
    G = tl.load(G_ptr + chunk_start * H_V + head + i * H_V, mask=row_ok, other=0.0)  # [C]
    G_end = tl.load(G_ptr + (tl.minimum(chunk_start + C, seq_end) - 1) * H_V + head,
                    mask=chunk_start < seq_end, other=0.0)  # guarded: an empty sequence has no last row
    # Missing rows: inverse norm 0 (and k = 0), so they add nothing.
    inv_norm = tl.load(k_inv_norm_ptr + chunk_start * H_K + head // GROUP + i * H_K, mask=row_ok, other=0.0)
    return w, k, u, tl.exp(G_end - G) * inv_norm, tl.exp(G_end)


@triton.jit
def _project(S, w, KEY_PARTS: tl.constexpr, TRANSPOSED: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """W·S0 over the d_k parts: [C, BV], or (W·S0)ᵀ = S0ᵀ·Wᵀ [BV, C] when TRANSPOSED."""
    if TRANSPOSED:
        out = _mm(S[0], tl.trans(w[0]), DOT_DTYPE)
        if KEY_PARTS == 2:
            out += _mm(S[1], tl.trans(w[1]), DOT_DTYPE)
    else:
        out = _mm(w[0], S[0], DOT_DTYPE)
        if KEY_PARTS == 2:
            out += _mm(w[1], S[1], DOT_DTYPE)
    return out


@triton.jit
def _accumulate(S_part, k_part, v_to_end, decay, TRANSPOSED: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """S·exp(G_C) + kᵀ·v_to_end for one d_k part (transposed: Sᵀ·exp(G_C) + v_to_endᵀ·k)."""
    if TRANSPOSED:
        return S_part * decay + _mm(v_to_end, k_part, DOT_DTYPE)
    else:
        return S_part * decay + _mm(tl.trans(k_part), v_to_end, DOT_DTYPE)


@triton.jit
def _chunk_step(S, tiles, chunk, chunk_start, seq_end, h_ptr, vnew_ptr, head, vv, v_ok, H_V, D_K, D_V,
                C: tl.constexpr, BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr, TRANSPOSED: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    """One chunk: save S0, u = U − W·S0 (saved), S ← S0·exp(G_C) + kᵀ·(u·exp(G_C − G))."""
    w, k, u, to_end, decay = tiles
    _store_state(h_ptr + (chunk.to(tl.int64) * H_V + head) * D_K * D_V, S, vv, v_ok, D_V, 1, D_K,
                 BLOCK_K, KEY_PARTS, TRANSPOSED)
    i = tl.arange(0, C)
    offsets, mask = _value_tile(i, vv, chunk_start + i < seq_end, v_ok, H_V * D_V, TRANSPOSED)
    v_new = u.to(tl.float32) - _project(S, w, KEY_PARTS, TRANSPOSED, DOT_DTYPE)
    tl.store(vnew_ptr + (chunk_start * H_V + head) * D_V + offsets, v_new.to(vnew_ptr.dtype.element_ty), mask=mask)
    # Decay and key norms folded into the values rather than the keys (fewer multiplies on the
    # sequential path).
    if TRANSPOSED:
        v_to_end = v_new * to_end[None, :]  # [BV, C]
    else:
        v_to_end = v_new * to_end[:, None]  # [C, BV]
    if KEY_PARTS == 2:
        return (_accumulate(S[0], k[0], v_to_end, decay, TRANSPOSED, DOT_DTYPE),
                _accumulate(S[1], k[1], v_to_end, decay, TRANSPOSED, DOT_DTYPE))
    else:
        return (_accumulate(S[0], k[0], v_to_end, decay, TRANSPOSED, DOT_DTYPE),)


@triton.jit
def _loop_body(S, prefetched, j, first_chunk, seq_start, seq_end, k_ptr, stride_kt, stride_kh, k_inv_norm_ptr,
               w_ptr, u_ptr, G_ptr, h_ptr, vnew_ptr, head, vv, v_ok, H_V, H_K, D_K, D_V,
               GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, KEY_PARTS: tl.constexpr,
               TRANSPOSED: tl.constexpr, PREFETCH: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Chunk j of the sequence; with PREFETCH, `prefetched` holds its tiles and chunk j + 1's are
    loaded first (before any maths of chunk j), else `prefetched` is an unused placeholder."""
    # A sequence's chunks are consecutive in the table and in the tokens: row addresses are
    # arithmetic in the loop index (no table load on the sequential path).
    chunk_start = seq_start + j * C
    if PREFETCH:
        tiles = prefetched
        load_start = chunk_start + C
    else:
        load_start = chunk_start
    loaded = _chunk_tiles(load_start, seq_end, k_ptr, stride_kt, stride_kh, k_inv_norm_ptr, w_ptr, u_ptr, G_ptr,
                          head, vv, v_ok, H_V, H_K, D_K, D_V, GROUP, C, BLOCK_K, KEY_PARTS, TRANSPOSED)
    if PREFETCH:
        prefetched = loaded
    else:
        tiles = loaded
    S = _chunk_step(S, tiles, first_chunk + j, chunk_start, seq_end, h_ptr, vnew_ptr, head, vv, v_ok, H_V, D_K, D_V,
                    C, BLOCK_K, KEY_PARTS, TRANSPOSED, DOT_DTYPE)
    return S, prefetched


@triton.jit
def state_pass_kernel(
    k_ptr, k_inv_norm_ptr, w_ptr, u_ptr, G_ptr, state_ptr, slots_ptr, cu_ptr, seq_offsets_ptr, h_ptr, vnew_ptr,
    stride_kt, stride_kh, stride_s0, stride_s1, stride_s2, H_V, H_K, D_K: tl.constexpr, D_V: tl.constexpr,
    GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    KEY_PARTS: tl.constexpr, TRANSPOSED: tl.constexpr, PREFETCH: tl.constexpr,
    DOT_DTYPE: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    """k is raw (k_inv_norm [T, H_k] from the WY kernel normalises it); u, w, G from the WY
    kernel. Writes the chunk states h [N, H_v, d_k, d_v], the new values and the final state."""
    # Grid (d_v block, value head, sequence): the sibling programs that read the same w / k tiles
    # every chunk are launched together, so those reads hit L2 (sequence-first, they did not).
    seq, head = tl.program_id(2), tl.program_id(1)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vv < D_V
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state_base = state_ptr + slot * stride_s0 + head * stride_s1
    S = _load_state(state_base, vv, v_ok, stride_s2, 1, D_K, BLOCK_K, KEY_PARTS, TRANSPOSED)

    seq_start = tl.load(cu_ptr + seq).to(tl.int64)
    seq_end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    first_chunk = tl.load(seq_offsets_ptr + seq)
    n_chunks = tl.load(seq_offsets_ptr + seq + 1) - first_chunk
    if PREFETCH:
        prefetched = _chunk_tiles(seq_start, seq_end, k_ptr, stride_kt, stride_kh, k_inv_norm_ptr, w_ptr, u_ptr,
                                  G_ptr, head, vv, v_ok, H_V, H_K, D_K, D_V, GROUP, C, BLOCK_K, KEY_PARTS, TRANSPOSED)
    else:
        prefetched = 0  # placeholder loop value (Triton cannot carry None through a loop)
    if LOOP_AS_WHILE:
        j = 0
        while j < n_chunks:
            S, prefetched = _loop_body(S, prefetched, j, first_chunk, seq_start, seq_end, k_ptr, stride_kt, stride_kh,
                                       k_inv_norm_ptr, w_ptr, u_ptr, G_ptr, h_ptr, vnew_ptr, head, vv, v_ok,
                                       H_V, H_K, D_K, D_V, GROUP, C, BLOCK_K, KEY_PARTS, TRANSPOSED, PREFETCH,
                                       DOT_DTYPE)
            j += 1
    else:
        for j in range(0, n_chunks):
            S, prefetched = _loop_body(S, prefetched, j, first_chunk, seq_start, seq_end, k_ptr, stride_kt, stride_kh,
                                       k_inv_norm_ptr, w_ptr, u_ptr, G_ptr, h_ptr, vnew_ptr, head, vv, v_ok,
                                       H_V, H_K, D_K, D_V, GROUP, C, BLOCK_K, KEY_PARTS, TRANSPOSED, PREFETCH,
                                       DOT_DTYPE)
    _store_state(state_base, S, vv, v_ok, stride_s2, 1, D_K, BLOCK_K, KEY_PARTS, TRANSPOSED)
