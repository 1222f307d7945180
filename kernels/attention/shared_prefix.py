"""Decode attention for rows that share a context prefix (cascade within fixed row blocks).

In a RAG-shaped decode step many consecutive rows hold the *same KV slots* for a long shared
prefix (the radix tree's slots). Plain split-K decoding streams that prefix once per row; here
rows are grouped in fixed blocks of `rows` consecutive rows and each block's common prefix is
streamed once for all of them:

- stage 1 (`run_shared_prefix_stage`, this file): one program per (block, KV head, split) loads
  the queries of every row of the block × the GQA heads of its KV head as one tile
  [rows·BLOCK_H, d] and streams its split of positions [0, S_b) from the block's first row's
  slots, writing one softmax partial per (row, head, split);
- stage 2: the plain split kernel (attention.py) over each row's own tail [S_b, ctx);
- the plain merge folds both stages' partials by their log-sum-exp.

S_b (`block_shared_len`) comes from the caller's hint `shared_with_prev[r]` (leading positions
where row r's slots equal row r-1's): the minimum over the block's rows after the first, and
over every row's context length. Both stages compute it themselves, so the grids depend on
shapes only and the op stays CUDA-graph capturable with the hint's contents changing per replay.

Also the home of `attend_tile` (the online-softmax step over one KV tile), `attend_range` (its
loop over a range of positions) and `softmax_partial` (a split's output and lse), which every
attention kernel uses (here rather than in attention.py so that imports run one way).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels._common import LOOP_AS_WHILE, multiprocessor_count

_NO_LIMIT = tl.constexpr(2**31 - 1)
# Triton 3.6's interpreter returns garbage from tl.dot on bf16 operands; there (CPU tests only)
# the operands go up to fp32 first. Same maths: bf16 products are exact in fp32, and the GPU's
# tensor-core dot accumulates in fp32 too.
_DOTS_IN_FP32 = tl.constexpr(LOOP_AS_WHILE)


@dataclass(frozen=True)
class SharedPrefixLaunch:
    """Knobs of the shared-prefix stage. `rows` (a power of two ≥ 2) rows form a block; at head
    dim 256 keep rows · next_pow2(GQA group) ≤ 64: the accumulator is that many fp32 rows of d.
    `num_splits` None: from shapes (`num_shared_splits`). Defaults: the H200 sweep's best at the
    rag shape (B = 256 in 8 groups of 32, prefix 2048, 24/4 heads × 256, bf16), well ahead of the
    spill-free offline pick and of 16-row blocks (docs/BENCHMARKS.md, "Shared-prefix
    attention")."""

    rows: int = 8
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    if _DOTS_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def as_compute(q, k_cache_ptr):
    """Queries in the dtype of the dots: the KV pool's; over an FP8 pool, fp16 for 16-bit queries
    (fp32 ones stay fp32), to which `attend_tile` widens the keys and values tile by tile. fp16,
    not bf16: e4m3 widens to fp16 in one instruction a pair, to bf16 in three a value, and those
    conversions bounded the decode kernel at the bf16 pool's speed (docs/BENCHMARKS.md, "FP8 KV
    cache"); fp16 holds every e4m3 value exactly and more of q's mantissa than bf16."""
    if k_cache_ptr.dtype.element_ty != tl.float8e4nv:
        q = q.to(k_cache_ptr.dtype.element_ty)
    elif q.dtype != tl.float32:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)  # fp16's range, not bf16's
    return q


@triton.jit
def attend_tile(q, m, l, acc, n0, hi, q_pos, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start, kv_head,
                stride_kc, stride_kh, stride_vc, stride_vh, scale, offs_d, mask_d,
                CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over context positions [n0, n0 + BLOCK_N) ∩ [0, hi).

    q [R, BD]; m, l [R]; acc [R, BD] fp32; q_pos [R] (context position of each row; with
    CAUSAL a row sees keys at positions <= its own). Returns the updated (m, l, acc).
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    slot = tl.load(kv_indices_ptr + ctx_start + offs_n, mask=mask_n, other=0).to(tl.int64)
    kv_mask = mask_n[:, None] & mask_d[None, :]
    keys = tl.load(k_cache_ptr + slot[:, None] * stride_kc + kv_head * stride_kh + offs_d[None, :],
                   mask=kv_mask, other=0.0).to(q.dtype)  # [BN, BD]
    values = tl.load(v_cache_ptr + slot[:, None] * stride_vc + kv_head * stride_vh + offs_d[None, :],
                     mask=kv_mask, other=0.0).to(q.dtype)  # [BN, BD]
    scores = _dot(q, tl.trans(keys), DOT_PRECISION) * scale  # [R, BN]
    visible = mask_n[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= q_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    # Every row sees at least one key in its first tile, so m is finite from then on (no inf - inf).
    m_new = tl.maximum(m, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def attend_range(q, lo, hi, q_pos, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start, kv_head,
                 stride_kc, stride_kh, stride_vc, stride_vh, scale, offs_d, mask_d,
                 R: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, LOOP_AS_WHILE: tl.constexpr):
    """Online softmax of the R query rows `q` [R, BD] over context positions [lo, hi), one
    `attend_tile` per BLOCK_N keys: the running (m [R], l [R], acc [R, BD]) at the end. l = 0
    where nothing was attended (an empty range)."""
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BLOCK_D], tl.float32)
    if LOOP_AS_WHILE:
        n0 = lo
        while n0 < hi:
            m, l, acc = attend_tile(q, m, l, acc, n0, hi, q_pos, k_cache_ptr, v_cache_ptr, kv_indices_ptr,
                                    ctx_start, kv_head, stride_kc, stride_kh, stride_vc, stride_vh, scale,
                                    offs_d, mask_d, CAUSAL, BLOCK_N, DOT_PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(lo, hi, BLOCK_N):
            m, l, acc = attend_tile(q, m, l, acc, n0, hi, q_pos, k_cache_ptr, v_cache_ptr, kv_indices_ptr,
                                    ctx_start, kv_head, stride_kc, stride_kh, stride_vc, stride_vh, scale,
                                    offs_d, mask_d, CAUSAL, BLOCK_N, DOT_PRECISION)
    return m, l, acc


@triton.jit
def softmax_partial(m, l, acc):
    """A split's (normalised output [R, BD], log-sum-exp [R]) for the merge; an empty split
    (l = 0) gets lse = -inf and so no weight."""
    lse = tl.where(l > 0, m + tl.log(tl.maximum(l, 1e-30)), float("-inf"))
    return acc / tl.where(l > 0, l, 1.0)[:, None], lse


@triton.jit
def block_shared_len(shared_ptr, kv_indptr_ptr, block, batch, ROWS: tl.constexpr):
    """S_b: leading context positions whose slots every row of row block `block` shares with
    the block's first row. 0 for a block of one row; never beyond any row's context."""
    offs = tl.arange(0, ROWS)
    rows = block * ROWS + offs
    in_batch = rows < batch
    ctx_len = tl.load(kv_indptr_ptr + rows + 1, mask=in_batch, other=0) - tl.load(
        kv_indptr_ptr + rows, mask=in_batch, other=0)  # [ROWS]
    # The first row's hint is about the previous block: not part of this block's promise.
    hint = tl.load(shared_ptr + rows, mask=in_batch & (offs > 0), other=_NO_LIMIT)  # [ROWS]
    shared = tl.minimum(tl.min(tl.where(in_batch, ctx_len, _NO_LIMIT), 0), tl.min(hint, 0))
    n_rows = tl.sum(in_batch.to(tl.int32), 0)
    return tl.where(n_rows > 1, tl.maximum(shared, 0), 0).to(tl.int32)


# The batch- and split-dependent runtime ints are not specialised: one variant for every graph
# bucket (as the decode split kernel, kernels/attention/attention.py).
@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "batch", "num_splits", "first_split"])
def _shared_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, kv_indices_ptr, kv_indptr_ptr, shared_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    scale, batch, num_splits, first_split,
    ROWS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LOOP_AS_WHILE: tl.constexpr,
):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    shared_len = block_shared_len(shared_ptr, kv_indptr_ptr, block, batch, ROWS)
    # The shared positions' slots are read once, from the block's first row.
    ctx_start = tl.load(kv_indptr_ptr + block * ROWS).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(shared_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, shared_len)

    # Tile row i is (row block·ROWS + i // BLOCK_H, query head i % BLOCK_H of this KV head).
    offs_r = tl.arange(0, ROWS * BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    rows = block * ROWS + offs_r // BLOCK_H
    head_in_group = offs_r % BLOCK_H
    mask_r = (head_in_group < GROUP) & (rows < batch)
    mask_d = offs_d < D
    heads = kv_head * GROUP + head_in_group
    q = as_compute(tl.load(q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                           mask=mask_r[:, None] & mask_d[None, :], other=0.0), k_cache_ptr)  # [RH, BD]

    m, l, acc = attend_range(q, lo, hi, offs_r, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start, kv_head,
                             stride_kc, stride_kh, stride_vc, stride_vh, scale, offs_d, mask_d,
                             ROWS * BLOCK_H, BLOCK_D, False, BLOCK_N, DOT_PRECISION, LOOP_AS_WHILE)
    out, lse = softmax_partial(m, l, acc)  # nothing shared (or an empty split): no weight in the merge
    part = first_split + split
    tl.store(part_o_ptr + rows[:, None] * stride_pb + heads[:, None] * stride_ph + part * stride_ps
             + offs_d[None, :], out, mask=mask_r[:, None] & mask_d[None, :])
    tl.store(part_lse_ptr + rows * stride_lb + heads * stride_lh + part, lse, mask=mask_r)


def num_shared_splits(batch: int, kv_heads: int, total_ctx: int, rows: int, device: torch.device) -> int:
    """Enough (block, KV head, split) programs to fill the GPU ~4 times over, no split shorter
    than ~256 tokens of the average context (the shared prefix is at most that long on average
    over a block). Shapes only, like the plain decode's split count."""
    blocks = triton.cdiv(batch, rows)
    avg_ctx = max(1, total_ctx // max(1, batch))
    want = triton.cdiv(4 * multiprocessor_count(device), blocks * kv_heads)
    return max(1, min(want, triton.cdiv(avg_ctx, 256), 32))


def run_shared_prefix_stage(q, k_cache, v_cache, kv_indices, kv_indptr, shared_with_prev, scale,
                            part_o, part_lse, first_split: int, num_splits: int, launch: SharedPrefixLaunch,
                            dot_precision: str) -> None:
    """Stage 1: partials over each block's shared prefix into part_o [B, H, ·, d] and
    part_lse [B, H, ·] at splits first_split .. first_split + num_splits - 1 (every
    (row, head, split) written, -inf where nothing is shared). launch.num_splits is not read."""
    B, H, d = q.shape
    H_kv = k_cache.shape[1]
    group = H // H_kv
    assert launch.rows >= 2 and launch.rows & (launch.rows - 1) == 0, "rows must be a power of two >= 2"
    # tl.dot needs at least 16 tile rows: widen the per-row head slot when rows·group is small.
    block_h = max(triton.next_power_of_2(group), 16 // launch.rows)
    # Block index fastest: the blocks of one group (same prefix) run side by side and share it in L2.
    grid = (triton.cdiv(B, launch.rows), H_kv, num_splits)
    _shared_prefix_kernel[grid](
        q, k_cache, v_cache, kv_indices, kv_indptr, shared_with_prev, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        scale, B, num_splits, first_split,
        ROWS=launch.rows, GROUP=group, D=d, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=launch.block_n, DOT_PRECISION=dot_precision, LOOP_AS_WHILE=LOOP_AS_WHILE,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
