"""The WY transform of the chunked GDN prefill (kernels/gdn_prefill/__init__.py has the maths): one
program per (chunk, key head) computes the Gram blocks of the chunk's keys once, then for each of
the key head's value heads in turn the gates and G, the chunk's triangular system and its inverse
by 16-row blocks, all in registers, and stores M⁻¹·diag(beta). W and U are never formed here: the
state pass applies the inverse to its own products (state_pass.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._common import L2NORM_EPS, KernelLaunch, gdn_gate_terms, next_pow2_at_least_16
from batchinfer.kernels.gdn_prefill.work import CHUNK, SUB, WY_KEY_STEP, PrefillWork, _load_rows, chunk_range


@triton.jit
def _sub_block_gates(a_base, b_base, stride_at, stride_bt, A_log, dt_bias, rows, ok, G_before):
    """Gates of one 16-row sub-block: (G, beta, G_before + Σg). G is the log-decay cumulated from
    the chunk start: the cumsum within the block plus G_before, the earlier blocks' sum. Missing
    rows get g = 0 and beta = 0 (no decay, no write), so G stays finite and flat there."""
    g, beta = gdn_gate_terms(
        tl.load(a_base + rows * stride_at, mask=ok, other=0.0).to(tl.float32),
        tl.load(b_base + rows * stride_bt, mask=ok, other=0.0).to(tl.float32),
        A_log, dt_bias,
    )
    g, beta = tl.where(ok, g, 0.0), tl.where(ok, beta, 0.0)
    return tl.cumsum(g, axis=0) + G_before, beta, G_before + tl.sum(g, axis=0)  # [SUB], [SUB], scalar


@triton.jit
def _inverse_norms(gram, SUB: tl.constexpr):
    """1 / ‖k_i‖ of a sub-block's raw keys from its diagonal Gram block k kᵀ: rsqrt(Σk² + eps), the
    reference's L2 normalisation, with no pass of its own over the keys."""
    r = tl.arange(0, SUB)
    return tl.rsqrt(tl.sum(tl.where(r[:, None] == r[None, :], gram, 0.0), axis=1) + L2NORM_EPS)  # [SUB]


@triton.jit
def _normalised(gram, inv_norm_i, inv_norm_j):
    """Gram block of the normalised keys from the raw keys' block: k̂_i·k̂_j = (k_i·k_j)/(‖k_i‖‖k_j‖)."""
    return gram * inv_norm_i[:, None] * inv_norm_j[None, :]


@triton.jit
def _system_block(gram, beta_i, G_i, G_j):
    """Block (i, j), i > j, of the system from its Gram block k_i k_jᵀ: beta_i ⊙ gram ⊙ exp(G_i − G_j).
    Rows of block i come after all of block j, so G_i ≤ G_j and the exponent never overflows."""
    return beta_i[:, None] * gram * tl.exp(G_i[:, None] - G_j[None, :])  # [SUB, SUB]


@triton.jit
def _inverse_diagonal_block(gram, beta, G, SUB: tl.constexpr):
    """X = (I + A)⁻¹ for the strictly lower diagonal block A = strict_lower(beta_i·k_i·k_j·exp(G_i − G_j))
    given its Gram block k kᵀ [SUB, SUB].

    Forward substitution on one register tile: row i of X is e_i − Σ_{j<i} A[i, j]·(row j of X).
    Substitution (not a Neumann/power product) stays backward stable in fp32 when keys are
    strongly correlated. A is built transposed (a_t[j, i] = A[i, j]; free, as k kᵀ is symmetric):
    then row i of A is a column of a_t, whose extraction reduces along the columns and lands laid
    out along the rows of X, as the update needs it (no layout shuffle per step).
    """
    r = tl.arange(0, SUB)[:, None]
    c = tl.arange(0, SUB)[None, :]
    # Masked before the exp, which could overflow above the diagonal.
    a_t = gram * beta[None, :] * tl.exp(tl.where(r < c, G[None, :] - G[:, None], float("-inf")))
    inv = tl.where(r == c, 1.0, 0.0)  # [SUB, SUB]
    for i in tl.static_range(1, SUB):
        coeffs = tl.sum(tl.where(c == i, a_t, 0.0), axis=1)  # [SUB] over j: A[i, j]
        correction = tl.sum(coeffs[:, None] * inv, axis=0)  # [SUB]: Σ_j A[i, j]·X[j, :]
        inv = tl.where(r == i, inv - correction[None, :], inv)
    return inv


@triton.jit(do_not_specialize=["chunk_lo"])
def chunk_wy_kernel(
    k_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, chunk_start_ptr, chunk_end_ptr, chunk_lo, G_ptr, k_inv_norm_ptr,
    minv_ptr, stride_kt, stride_kh, stride_at, stride_bt, H_V, H_K, D_K,
    GROUP: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr, K_STEP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (chunk, key head): its normalised keys' Gram blocks and inverse norms (stored, [T, H_k]
    fp32, for the later kernels), then for each of its GROUP value heads G (stored) and
    M⁻¹·diag(beta) ([N, H_v, C, C] in minv's dtype: the 10 lower 16×16 blocks; the upper ones are
    never written and never read). The GROUP value heads differ only in their gates, so the keys
    are loaded and multiplied once for all of them (docs/BENCHMARKS.md, "GDN prefill: WY and
    output kernels per key head").

    Keys are raw (not normalised): the kernel works on the raw keys' Gram blocks and rescales them
    by the inverse key norms, which their diagonal blocks give. No separate normalisation launch,
    and no normalised copy of q or k.

    A register tile cannot be sliced, so the C = 4·SUB rows are four named sub-blocks (suffix
    0..3, local rows r0..r3) from the start; the Gram products sweep d_k in K_STEP slices (every
    warp holds the whole left operand of a 16-row product: whole [16, d_k] key tiles would cost
    far more registers than the maths needs).

    The keys enter the tensor cores in the input dtype, and M⁻¹·diag(beta) is stored in minv's
    (the input dtype: work.py). PRECISION is for products of fp32 operands (M⁻¹'s
    off-diagonal blocks): "ieee" for fp32 inputs (exact path throughout), "tf32" for 16-bit
    inputs, where the blocks are rounded to 16 bits when stored anyway (as fla does).
    """
    tl.static_assert(C == 4 * SUB)
    # Grid (key head, chunk of the launch's piece of the table, which starts at chunk_lo): a
    # chunk's key heads run together.
    key_head, chunk = tl.program_id(0), chunk_lo + tl.program_id(1)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    n_rows = tl.load(chunk_end_ptr + chunk) - start.to(tl.int32)
    if n_rows <= 0:  # an unused tail chunk of the table
        return
    r0 = tl.arange(0, SUB)
    r1, r2, r3 = r0 + SUB, r0 + 2 * SUB, r0 + 3 * SUB
    ok0, ok1, ok2, ok3 = r0 < n_rows, r1 < n_rows, r2 < n_rows, r3 < n_rows
    n0, n1, n2, n3, kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33 = _normalised_gram(
        k_ptr + start * stride_kt + key_head * stride_kh, stride_kt, r0, r1, r2, r3, ok0, ok1, ok2, ok3, D_K, SUB,
        BLOCK_K, K_STEP, PRECISION)
    n_base = k_inv_norm_ptr + start * H_K + key_head
    tl.store(n_base + r0 * H_K, n0, mask=ok0)
    tl.store(n_base + r1 * H_K, n1, mask=ok1)
    tl.store(n_base + r2 * H_K, n2, mask=ok2)
    tl.store(n_base + r3 * H_K, n3, mask=ok3)
    # A loop, not unrolled: one value head's inverse at a time keeps the registers of one.
    for g in range(GROUP):
        _head_inverse(key_head * GROUP + g, chunk, start, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, G_ptr, minv_ptr,
                      stride_at, stride_bt, r0, r1, r2, r3, ok0, ok1, ok2, ok3,
                      kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33, H_V, C, SUB, PRECISION)


@triton.jit
def _normalised_gram(k_base, k_row, r0, r1, r2, r3, ok0, ok1, ok2, ok3, D_K, SUB: tl.constexpr,
                     BLOCK_K: tl.constexpr, K_STEP: tl.constexpr, PRECISION: tl.constexpr):
    """The inverse key norms n0..n3 [SUB] and the 10 Gram blocks k̂_i k̂_jᵀ (j ≤ i) of the chunk's
    normalised keys, from the raw keys (input dtype) over d_k in K_STEP slices; missing rows and
    columns load as 0. Missing rows have norm 0 and an inverse norm of eps^-½: finite, and their
    raw keys are 0, so every product with them stays 0."""
    kk00 = tl.zeros((SUB, SUB), dtype=tl.float32)
    kk10, kk11, kk20, kk21, kk22 = kk00, kk00, kk00, kk00, kk00
    kk30, kk31, kk32, kk33 = kk00, kk00, kk00, kk00
    for k_step in range(0, BLOCK_K, K_STEP):
        cols = k_step + tl.arange(0, K_STEP)
        col_ok = cols < D_K
        k0 = _load_rows(k_base, r0, ok0, k_row, cols, col_ok)  # [SUB, K_STEP]
        k1 = _load_rows(k_base, r1, ok1, k_row, cols, col_ok)
        k2 = _load_rows(k_base, r2, ok2, k_row, cols, col_ok)
        k3 = _load_rows(k_base, r3, ok3, k_row, cols, col_ok)
        kk00 = tl.dot(k0, tl.trans(k0), kk00, input_precision=PRECISION)
        kk10 = tl.dot(k1, tl.trans(k0), kk10, input_precision=PRECISION)
        kk11 = tl.dot(k1, tl.trans(k1), kk11, input_precision=PRECISION)
        kk20 = tl.dot(k2, tl.trans(k0), kk20, input_precision=PRECISION)
        kk21 = tl.dot(k2, tl.trans(k1), kk21, input_precision=PRECISION)
        kk22 = tl.dot(k2, tl.trans(k2), kk22, input_precision=PRECISION)
        kk30 = tl.dot(k3, tl.trans(k0), kk30, input_precision=PRECISION)
        kk31 = tl.dot(k3, tl.trans(k1), kk31, input_precision=PRECISION)
        kk32 = tl.dot(k3, tl.trans(k2), kk32, input_precision=PRECISION)
        kk33 = tl.dot(k3, tl.trans(k3), kk33, input_precision=PRECISION)
    n0, n1 = _inverse_norms(kk00, SUB), _inverse_norms(kk11, SUB)
    n2, n3 = _inverse_norms(kk22, SUB), _inverse_norms(kk33, SUB)
    kk00, kk11 = _normalised(kk00, n0, n0), _normalised(kk11, n1, n1)
    kk22, kk33 = _normalised(kk22, n2, n2), _normalised(kk33, n3, n3)
    kk10, kk20, kk30 = _normalised(kk10, n1, n0), _normalised(kk20, n2, n0), _normalised(kk30, n3, n0)
    kk21, kk31, kk32 = _normalised(kk21, n2, n1), _normalised(kk31, n3, n1), _normalised(kk32, n3, n2)
    return n0, n1, n2, n3, kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33


@triton.jit
def _head_inverse(head, chunk, start, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, G_ptr, minv_ptr, stride_at, stride_bt,
                  r0, r1, r2, r3, ok0, ok1, ok2, ok3, kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33,
                  H_V, C: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """One value head of the chunk, given its key head's normalised Gram blocks: the gates and G
    (stored: the later kernels read it), M⁻¹ by blocks, and M⁻¹·diag(beta) stored."""
    A_log = tl.load(A_log_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    a_base, b_base = a_ptr + start * stride_at + head, b_ptr + start * stride_bt + head
    G0, beta0, G_so_far = _sub_block_gates(a_base, b_base, stride_at, stride_bt, A_log, dt_bias, r0, ok0, 0.0)
    G1, beta1, G_so_far = _sub_block_gates(a_base, b_base, stride_at, stride_bt, A_log, dt_bias, r1, ok1, G_so_far)
    G2, beta2, G_so_far = _sub_block_gates(a_base, b_base, stride_at, stride_bt, A_log, dt_bias, r2, ok2, G_so_far)
    G3, beta3, G_so_far = _sub_block_gates(a_base, b_base, stride_at, stride_bt, A_log, dt_bias, r3, ok3, G_so_far)
    G_base = G_ptr + start * H_V + head
    tl.store(G_base + r0 * H_V, G0, mask=ok0)
    tl.store(G_base + r1 * H_V, G1, mask=ok1)
    tl.store(G_base + r2 * H_V, G2, mask=ok2)
    tl.store(G_base + r3 * H_V, G3, mask=ok3)

    # M⁻¹ of the block lower-triangular M = I + A: diagonal blocks X_ii by substitution, then
    # block row i as Inv_ij = −X_ii · Σ_{j≤m<i} A_im · Inv_mj, one block diagonal after the other.
    x00 = _inverse_diagonal_block(kk00, beta0, G0, SUB)
    x11 = _inverse_diagonal_block(kk11, beta1, G1, SUB)
    x22 = _inverse_diagonal_block(kk22, beta2, G2, SUB)
    x33 = _inverse_diagonal_block(kk33, beta3, G3, SUB)
    a10 = _system_block(kk10, beta1, G1, G0)
    a21 = _system_block(kk21, beta2, G2, G1)
    a32 = _system_block(kk32, beta3, G3, G2)
    i10 = -tl.dot(x11, tl.dot(a10, x00, input_precision=PRECISION), input_precision=PRECISION)
    i21 = -tl.dot(x22, tl.dot(a21, x11, input_precision=PRECISION), input_precision=PRECISION)
    i32 = -tl.dot(x33, tl.dot(a32, x22, input_precision=PRECISION), input_precision=PRECISION)
    a20 = _system_block(kk20, beta2, G2, G0)
    a31 = _system_block(kk31, beta3, G3, G1)
    sum20 = tl.dot(a21, i10, tl.dot(a20, x00, input_precision=PRECISION), input_precision=PRECISION)
    i20 = -tl.dot(x22, sum20, input_precision=PRECISION)
    sum31 = tl.dot(a32, i21, tl.dot(a31, x11, input_precision=PRECISION), input_precision=PRECISION)
    i31 = -tl.dot(x33, sum31, input_precision=PRECISION)
    a30 = _system_block(kk30, beta3, G3, G0)
    sum30 = tl.dot(a31, i10, tl.dot(a30, x00, input_precision=PRECISION), input_precision=PRECISION)
    i30 = -tl.dot(x33, tl.dot(a32, i20, sum30, input_precision=PRECISION), input_precision=PRECISION)
    _store_inverse_times_beta(minv_ptr + (chunk.to(tl.int64) * H_V + head) * C * C, C, SUB,
                              x00, i10, x11, i20, i21, x22, i30, i31, i32, x33, beta0, beta1, beta2, beta3)


@triton.jit
def _store_inverse_times_beta(base, C: tl.constexpr, SUB: tl.constexpr,
                              x00, i10, x11, i20, i21, x22, i30, i31, i32, x33, beta0, beta1, beta2, beta3):
    """M⁻¹·diag(beta) as its 10 lower blocks at base [C, C] row-major, in base's dtype. Rows and
    columns past the chunk end need no mask: beta is 0 there (zero columns) and those rows are
    identity rows the state pass multiplies by zero values."""
    r = tl.arange(0, SUB)
    _store_block(base, r, 0, 0, C, SUB, x00 * beta0[None, :])
    _store_block(base, r, 1, 0, C, SUB, i10 * beta0[None, :])
    _store_block(base, r, 1, 1, C, SUB, x11 * beta1[None, :])
    _store_block(base, r, 2, 0, C, SUB, i20 * beta0[None, :])
    _store_block(base, r, 2, 1, C, SUB, i21 * beta1[None, :])
    _store_block(base, r, 2, 2, C, SUB, x22 * beta2[None, :])
    _store_block(base, r, 3, 0, C, SUB, i30 * beta0[None, :])
    _store_block(base, r, 3, 1, C, SUB, i31 * beta1[None, :])
    _store_block(base, r, 3, 2, C, SUB, i32 * beta2[None, :])
    _store_block(base, r, 3, 3, C, SUB, x33 * beta3[None, :])


@triton.jit
def _store_block(base, r, row_block: tl.constexpr, col_block: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr,
                 block):
    offsets = (row_block * SUB + r)[:, None] * C + (col_block * SUB + r)[None, :]
    tl.store(base + offsets, block.to(base.dtype.element_ty))


def run_wy(work: PrefillWork, launch: KernelLaunch, chunks: tuple[int, int] | None = None) -> None:
    """`chunks`: the piece [lo, hi) of the chunk table to run (None: all of it); likewise below."""
    T, H_k, d_k, H_v, d_v = work.dims
    block_k = next_pow2_at_least_16(d_k)
    lo, hi = chunk_range(work, chunks)
    chunk_wy_kernel[(H_k, hi - lo)](
        work.k, work.a, work.b, work.A_log, work.dt_bias, work.chunks.start, work.chunks.seq_end, lo,
        work.G, work.k_inv_norm, work.minv,
        work.k.stride(0), work.k.stride(1), work.a.stride(0), work.b.stride(0), H_v, H_k, d_k,
        GROUP=H_v // H_k, C=CHUNK, SUB=SUB, BLOCK_K=block_k, K_STEP=min(WY_KEY_STEP, block_k),
        PRECISION="ieee" if work.q.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
