"""Triton attention over a token-granular KV pool (contract: docs/MODULES.md; reference:
kernels/ref/attention.py).

- `store_kv`: one program per new token copies its k and v rows into the pools.
- `attention_decode`: split-K flash decoding. One program per (sequence, KV head, split)
  streams its share of the gathered context once for all GQA query heads of that KV head
  (they are the rows of one tl.dot), then a small kernel merges the splits by their
  log-sum-exp. Decode is bound by KV bytes, so the split count only has to give enough
  programs to keep every SM streaming; it is chosen from shapes alone (no device sync, so
  the launch can be captured in a CUDA graph). With the `shared_with_prev` hint, blocks of
  consecutive rows stream their common prefix once (shared_prefix.py) and the
  split kernel covers only each row's own tail; the merge folds both.
- `attention_prefill`: a causal varlen flash kernel over the slot table (Triton, not
  gather + SDPA: the gather would copy every cached prefix once per step and SDPA cannot
  take a per-sequence offset causal mask without materialising it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._common import LOOP_AS_WHILE
from batchinfer.kernels.attention.shared_prefix import (SharedPrefixLaunch, as_compute, attend_range, block_shared_len,
                                                       num_shared_splits, run_shared_prefix_stage, softmax_partial)
from batchinfer.kernels.ref.attention import FP8_KV_DTYPES, store_kv as reference_store_kv


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                     stride_kt, stride_vt, stride_kc, stride_vc,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    for start in range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ROW
        key = tl.load(k_ptr + token * stride_kt + offs, mask=mask)
        value = tl.load(v_ptr + token * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + slot * stride_kc + offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * stride_vc + offs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, d] with each token's H·d values contiguous (what the kernels index)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def store_kv(k, v, k_cache, v_cache, out_slots) -> None:
    """Scatter k, v [T, H_kv, d] into k_cache, v_cache [S_kv, H_kv, d] at out_slots [T]."""
    T = k.shape[0]
    if T == 0:
        return
    if k_cache.dtype in FP8_KV_DTYPES:  # torch's saturated cast: one rounding on every device
        reference_store_kv(k, v, k_cache, v_cache, out_slots)
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    k, v = _rows(k), _rows(v)
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(T,)](k, v, k_cache, v_cache, out_slots,
                           k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0),
                           ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)))


# Runtime ints that vary with the batch or the split count (the CUDA-graph buckets) are not
# specialised: one compiled variant serves every bucket (triton otherwise compiles one per class
# of each: 1, a multiple of 16, other). None of them addresses memory whose alignment matters:
# the lse strides (heads × splits, splits) step one fp32 per program.
@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "batch", "num_splits"])
def _attn_decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, kv_indices_ptr, kv_indptr_ptr, shared_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    scale, batch, num_splits,
    GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SHARED_ROWS: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_start = tl.load(kv_indptr_ptr + seq).to(tl.int64)
    ctx_len = (tl.load(kv_indptr_ptr + seq + 1) - ctx_start).to(tl.int32)
    # SHARED_ROWS > 0: the row block's shared prefix is the shared-prefix stage's; this kernel
    # takes the row's own tail only. 0 (no hint): the whole context, shared_ptr unused.
    own_start = 0
    if SHARED_ROWS > 0:
        own_start = block_shared_len(shared_ptr, kv_indptr_ptr, seq // SHARED_ROWS, batch, SHARED_ROWS)
    # Each split takes a whole number of BLOCK_N tiles; trailing splits may be empty.
    per_split = tl.cdiv(tl.cdiv(ctx_len - own_start, num_splits), BLOCK_N) * BLOCK_N
    lo = own_start + split * per_split
    hi = tl.minimum(lo + per_split, ctx_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < D
    heads = kv_head * GROUP + offs_h  # the GQA query heads of this KV head
    q = as_compute(tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                           mask=mask_h[:, None] & mask_d[None, :], other=0.0), k_cache_ptr)  # [BH, BD]

    m, l, acc = attend_range(q, lo, hi, offs_h, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start, kv_head,
                             stride_kc, stride_kh, stride_vc, stride_vh, scale, offs_d, mask_d,
                             BLOCK_H, BLOCK_D, False, BLOCK_N, DOT_PRECISION, LOOP_AS_WHILE)
    out, lse = softmax_partial(m, l, acc)  # an empty split carries no weight in the merge
    tl.store(part_o_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
             out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _merge_block(part_o_ptr, part_lse_ptr, seq, head, s0, num_splits, m, w, acc,
                 stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, offs_d, mask_d, BLOCK_S: tl.constexpr):
    """Fold splits [s0, s0 + BLOCK_S) into the running (max m, weight sum w, weighted sum acc [BD])."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m_new = tl.maximum(m, tl.max(lse, 0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: every weight below is 0
    weight = tl.exp(lse - m_ref)  # [BS]; empty splits get 0
    parts = tl.load(part_o_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=(mask_s & (lse > float("-inf")))[:, None] & mask_d[None, :], other=0.0)  # [BS, BD]
    rescale = tl.exp(m - m_ref)
    return m_new, w * rescale + tl.sum(weight, 0), acc * rescale + tl.sum(parts * weight[:, None], 0)


# BLOCK_S is fixed (not the split count's power of two) so every bucket shares one variant;
# more splits take more blocks. 32: a [32, 256] fp32 tile stays in registers at 4 warps (128
# would spill), and the split counts of large batches (the graph buckets) fit one block.
MERGE_BLOCK_S = 32


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "num_splits"])
def _attn_decode_merge_kernel(
    part_o_ptr, part_lse_ptr, o_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    m = tl.full((), float("-inf"), tl.float32)
    w = tl.zeros((), tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    if LOOP_AS_WHILE:  # the interpreter: no runtime-bounded `for`
        s0 = 0
        while s0 < num_splits:
            m, w, acc = _merge_block(part_o_ptr, part_lse_ptr, seq, head, s0, num_splits, m, w, acc,
                                     stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, offs_d, mask_d, BLOCK_S)
            s0 += BLOCK_S
    else:
        for s0 in range(0, num_splits, BLOCK_S):
            m, w, acc = _merge_block(part_o_ptr, part_lse_ptr, seq, head, s0, num_splits, m, w, acc,
                                     stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, offs_d, mask_d, BLOCK_S)
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_d, (acc / w).to(o_ptr.dtype.element_ty), mask=mask_d)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32: tests compare fp32 against the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_decode_splits(batch: int, kv_heads: int, total_ctx: int, device: torch.device) -> int:
    """Enough (sequence, KV head, split) programs to fill the GPU ~4 times over, but no split
    shorter than ~256 tokens. Uses shapes only: kv_indices.numel() is known on the host."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    avg_ctx = max(1, total_ctx // max(1, batch))
    want = triton.cdiv(4 * sms, batch * kv_heads)
    return max(1, min(want, triton.cdiv(avg_ctx, 256), 64))


def _default_decode_tile(k_cache: torch.Tensor) -> tuple[int, int]:
    """(block_n, num_stages) for the split kernel over this pool: the H200 sweeps' best. An FP8
    pool's tile of 128 keys holds the bytes of a 16-bit pool's tile of 64 (bench_replay_attn
    --fp8-kv: 0.81-0.84x the time of the 64-key launch at 96 and 256 rows)."""
    return (128, 2) if k_cache.element_size() == 1 else (64, 3)


def attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale, *, shared_with_prev=None, out=None,
                     num_splits: int | None = None, block_n: int | None = None, num_warps: int = 4,
                     num_stages: int | None = None, shared_launch: SharedPrefixLaunch = SharedPrefixLaunch()):
    """One query per sequence over its whole context. q [B, H, d] → o [B, H, d] in q.dtype.

    `shared_with_prev` (int32 [B] or None): the caller's promise that row r's first
    `shared_with_prev[r]` context slots equal row r-1's; the result is the same, but rows
    sharing a prefix within a block of `shared_launch.rows` read it once. Keyword knobs
    (`num_splits`, `block_n`, `num_warps`, `num_stages`, `shared_launch`) are for
    benchmarks/tests. Defaults: the H200 sweep's best at batch 128, at about copy bandwidth
    (docs/BENCHMARKS.md, "Kernels against fla-core" and "Shared-prefix attention"); over an FP8
    pool a tile of twice the keys (`_default_decode_tile`).
    """
    B, H, d = q.shape
    H_kv = k_cache.shape[1]
    o = torch.empty_like(q) if out is None else out
    if B == 0:
        return o
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    splits = num_splits or _num_decode_splits(B, H_kv, kv_indices.numel(), q.device)
    default_block_n, default_stages = _default_decode_tile(k_cache)
    block_n, num_stages = block_n or default_block_n, num_stages or default_stages
    shared_splits = 0
    if shared_with_prev is not None:
        shared_splits = shared_launch.num_splits or num_shared_splits(
            B, H_kv, kv_indices.numel(), shared_launch.rows, q.device)
    # Partials: the split kernel's at [0, splits), the shared-prefix stage's after them.
    part_o = torch.empty((B, H, splits + shared_splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, H, splits + shared_splits), dtype=torch.float32, device=q.device)
    group = H // H_kv
    block_d = triton.next_power_of_2(d)
    _attn_decode_split_kernel[(B, H_kv, splits)](
        q, k_cache, v_cache, kv_indices, kv_indptr, kv_indptr if shared_with_prev is None else shared_with_prev,
        part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        scale, B, splits,
        GROUP=group, D=d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), SHARED_ROWS=0 if shared_with_prev is None else shared_launch.rows,
        LOOP_AS_WHILE=LOOP_AS_WHILE, num_warps=num_warps, num_stages=num_stages,
    )
    if shared_with_prev is not None:
        assert shared_with_prev.numel() == B and shared_with_prev.device == q.device
        run_shared_prefix_stage(q, k_cache, v_cache, kv_indices, kv_indptr, shared_with_prev, scale,
                                part_o, part_lse, splits, shared_splits, shared_launch, _dot_precision(q.dtype))
    _attn_decode_merge_kernel[(B, H)](
        part_o, part_lse, o,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        o.stride(0), o.stride(1),
        splits + shared_splits, D=d, BLOCK_S=MERGE_BLOCK_S, BLOCK_D=block_d, LOOP_AS_WHILE=LOOP_AS_WHILE,
    )
    return o


@triton.jit
def _prefill_sequence(cu_seqlens_ptr, kv_indptr_ptr, seq):
    """Sequence `seq`'s (first new-token row, new tokens, first context index, context length)."""
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    n_new = (tl.load(cu_seqlens_ptr + seq + 1) - q_start).to(tl.int32)
    ctx_start = tl.load(kv_indptr_ptr + seq).to(tl.int64)
    ctx_len = (tl.load(kv_indptr_ptr + seq + 1) - ctx_start).to(tl.int32)
    return q_start, n_new, ctx_start, ctx_len


@triton.jit
def _load_query_block(q_ptr, k_cache_ptr, stride_qt, stride_qh, head, q_start, n_new, ctx_len, q_block,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query rows q_block·BLOCK_M.. of a sequence's new tokens, in the dtype of the dots (q [BM, BD]),
    with their row offsets, row / channel masks and context positions (new tokens end the context)."""
    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < n_new
    mask_d = offs_d < D
    q_pos = ctx_len - n_new + offs_m  # [BM]
    q = as_compute(tl.load(q_ptr + (q_start + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
                           mask=mask_m[:, None] & mask_d[None, :], other=0.0), k_cache_ptr)
    return q, offs_m, offs_d, mask_m, mask_d, q_pos


@triton.jit
def _attn_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, kv_indices_ptr, kv_indptr_ptr, cu_seqlens_ptr, o_ptr,
    stride_qt, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh, stride_ot, stride_oh,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LOOP_AS_WHILE: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start, n_new, ctx_start, ctx_len = _prefill_sequence(cu_seqlens_ptr, kv_indptr_ptr, seq)
    if q_block * BLOCK_M >= n_new:
        return
    q, offs_m, offs_d, mask_m, mask_d, q_pos = _load_query_block(
        q_ptr, k_cache_ptr, stride_qt, stride_qh, head, q_start, n_new, ctx_len, q_block, D, BLOCK_M, BLOCK_D)

    # Keys beyond the block's last query position are masked for every row: stop there.
    kv_end = tl.minimum(ctx_len, ctx_len - n_new + (q_block + 1) * BLOCK_M)
    m, l, acc = attend_range(q, 0, kv_end, q_pos, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start, kv_head,
                             stride_kc, stride_kh, stride_vc, stride_vh, scale, offs_d, mask_d,
                             BLOCK_M, BLOCK_D, True, BLOCK_N, DOT_PRECISION, LOOP_AS_WHILE)
    out = acc / l[:, None]
    tl.store(o_ptr + (q_start + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def attention_prefill(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *, out=None,
                      max_seqlen: int | None = None, block_m: int = 64, block_n: int = 32, num_warps: int = 8):
    """Causal varlen attention; each sequence's new tokens are the last of its context.

    q [T, H, d] → o [T, H, d] in q.dtype. `max_seqlen` (longest new-token run) sizes the
    grid; without it one device sync reads it from cu_seqlens.
    """
    T, H, d = q.shape
    H_kv = k_cache.shape[1]
    B = cu_seqlens.numel() - 1
    o = torch.empty_like(q) if out is None else out
    if T == 0 or B == 0:
        return o
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    block_d = triton.next_power_of_2(d)
    grid = (triton.cdiv(max_seqlen, block_m), B, H)
    _attn_prefill_kernel[grid](
        q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, o,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        o.stride(0), o.stride(1),
        scale,
        GROUP=H // H_kv, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype), LOOP_AS_WHILE=LOOP_AS_WHILE, num_warps=num_warps,
    )
    return o
