"""The output stage of the chunked GDN prefill (kernels/gdn_prefill/__init__.py has the maths):
one program per (chunk, key head, d_v block) forms the outputs of the key head's value heads from
the saved q·S0 and new values, fully parallel."""
from __future__ import annotations

import triton
import triton.language as tl

from batchinfer.kernels._common import L2NORM_EPS, TRITON_DTYPES, KernelLaunch, next_pow2_at_least_16
from batchinfer.kernels.gdn_prefill.work import CHUNK, PrefillWork, _chunk_rows, _mm, chunk_range


@triton.jit(do_not_specialize=["chunk_lo"])
def chunk_output_kernel(
    q_ptr, k_ptr, k_inv_norm_ptr, G_ptr, qs_ptr, vnew_ptr, out_ptr, chunk_start_ptr, chunk_end_ptr, chunk_lo,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, H_V, H_K, D_K, D_V, scale,
    GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """o = (q̂·exp(G))·S0 + causal(q̂·k̂ᵀ · exp(G_i − G_j))·u for one (chunk, key head, d_v block) and
    each of the key head's GROUP value heads in turn, with q·S0 (raw q) from the state pass.

    The value heads of a key head differ only in G, u and q·S0: q̂·k̂ᵀ and q's norms are computed
    once for all of them (docs/BENCHMARKS.md, "GDN prefill: WY and output kernels per key head").
    q and k are raw: the products run on them (exact 16-bit operands) and the normalisation is
    folded into their rows afterwards: q's inverse norm (times d_k^-½) from the whole q rows
    loaded here, k's from the WY kernel (k_inv_norm)."""
    # Grid (d_v block, key head, chunk of the launch's piece of the table, from chunk_lo): the d_v
    # blocks of one (chunk, key head), which load the same q / k tiles, run together.
    chunk, key_head = chunk_lo + tl.program_id(2), tl.program_id(1)
    start, n_rows, i, rows, row_ok = _chunk_rows(chunk_start_ptr, chunk_end_ptr, chunk, C)
    if n_rows <= 0:  # an unused tail chunk of the table
        return
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < D_K, vv < D_V
    qk_mask = row_ok[:, None] & k_ok[None, :]
    q = tl.load(q_ptr + start * stride_qt + key_head * stride_qh + i[:, None] * stride_qt + kk[None, :],
                mask=qk_mask, other=0.0)  # [C, BK] raw
    k = tl.load(k_ptr + start * stride_kt + key_head * stride_kh + i[:, None] * stride_kt + kk[None, :],
                mask=qk_mask, other=0.0)  # [C, BK] raw
    k_inv_norm = tl.load(k_inv_norm_ptr + start * H_K + key_head + i * H_K, mask=row_ok, other=0.0)  # [C]
    q32 = q.to(tl.float32)
    q_scale = tl.rsqrt(tl.sum(q32 * q32, axis=1) + L2NORM_EPS) * scale  # [C]: 1/‖q‖ · d_k^-½
    normalised_scores = _mm(q, tl.trans(k), DOT_DTYPE) * (q_scale[:, None] * k_inv_norm[None, :])  # [C, C]
    causal = (i[:, None] >= i[None, :]) & row_ok[:, None]  # missing rows have G = 0: keep exp finite
    tile_ok = row_ok[:, None] & v_ok[None, :]
    for g in range(GROUP):
        head = key_head * GROUP + g
        G = tl.load(G_ptr + rows * H_V + head, mask=row_ok, other=0.0)  # [C]
        tile = (start * H_V + head) * D_V + i[:, None] * (H_V * D_V) + vv[None, :]  # [C, BV] in [T, H_v, d_v]
        q_projected = tl.load(qs_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)  # [C, BV]: raw q·S0
        v_new = tl.load(vnew_ptr + tile, mask=tile_ok, other=0.0)  # [C, BV]
        scores = normalised_scores * tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))  # [C, C]
        # The row scale after the product (diag(s)·(q·S0) = (diag(s)·q)·S0): the state pass
        # multiplies q as loaded.
        o = q_projected * (q_scale * tl.exp(G))[:, None] + _mm(scores, v_new, DOT_DTYPE)  # [C, BV]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + vv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=tile_ok)


def run_output(work: PrefillWork, launch: KernelLaunch, chunks: tuple[int, int] | None = None) -> None:
    T, H_k, d_k, H_v, d_v = work.dims
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    lo, hi = chunk_range(work, chunks)
    chunk_output_kernel[(triton.cdiv(d_v, block_v), H_k, hi - lo)](
        work.q, work.k, work.k_inv_norm, work.G, work.q_states, work.v_new, work.out,
        work.chunks.start, work.chunks.seq_end, lo, work.q.stride(0), work.q.stride(1), work.k.stride(0),
        work.k.stride(1), work.out.stride(0), work.out.stride(1), H_v, H_k, d_k, d_v, d_k ** -0.5,
        GROUP=H_v // H_k, C=CHUNK, BLOCK_K=next_pow2_at_least_16(d_k), BLOCK_V=block_v,
        DOT_DTYPE=TRITON_DTYPES[work.q.dtype], num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
