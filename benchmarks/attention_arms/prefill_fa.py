"""FlashAttention-2-style causal varlen prefill over the token-granular KV pool (same contract as
`attention_prefill`, docs/MODULES.md; reference: kernels/ref/attention.py).

A comparison arm (`triton-fa`) of benchmarks/attention_backends.py; the model does not run it.
Against kernels/attention/attention.py's prefill kernel: the softmax runs in base 2 with the scale and
log2(e) folded into one multiply; each query block's key range splits into the tiles every row
sees in full (no masks at all) and the diagonal tiles (bounds + causal mask), and stops at the
block's last query; heads are the fastest grid axis, so the GQA heads of one KV head run side by
side and read its K/V tiles from L2; the latest (longest) query blocks launch first; on CUDA the
tile shape comes from a small autotune list (per head dim, GQA group and run-length bucket).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels._common import LOOP_AS_WHILE
from batchinfer.kernels.attention.attention import _load_query_block, _prefill_sequence
from batchinfer.kernels.attention.shared_prefix import _dot  # fp32 operands under the interpreter

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class FaLaunch:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


AUTOTUNE = [FaLaunch(128, 64, 8, 2), FaLaunch(128, 32, 8, 3), FaLaunch(128, 64, 8, 3), FaLaunch(64, 64, 4, 3),
            FaLaunch(64, 64, 8, 2), FaLaunch(64, 32, 4, 3), FaLaunch(128, 128, 8, 2)]


@triton.jit
def _tile(q, m, l, acc, n0, q_pos, kv_end, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start, kv_head,
          stride_kc, stride_kh, stride_vc, stride_vh, qk_scale, offs_d, mask_d,
          MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step (base 2) over keys [n0, n0 + BLOCK_N). MASKED: the diagonal /
    last tiles (keys ≥ kv_end or after a row's position are dropped); else every row sees all."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < kv_end
        slot = tl.load(kv_indices_ptr + ctx_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        keys = tl.load(k_cache_ptr + slot[:, None] * stride_kc + kv_head * stride_kh + offs_d[None, :],
                       mask=kv_mask, other=0.0)  # [BN, BD]
        values = tl.load(v_cache_ptr + slot[:, None] * stride_vc + kv_head * stride_vh + offs_d[None, :],
                         mask=kv_mask, other=0.0)
    else:
        slot = tl.load(kv_indices_ptr + ctx_start + offs_n).to(tl.int64)
        if EVEN_D:
            keys = tl.load(k_cache_ptr + slot[:, None] * stride_kc + kv_head * stride_kh + offs_d[None, :])
            values = tl.load(v_cache_ptr + slot[:, None] * stride_vc + kv_head * stride_vh + offs_d[None, :])
        else:
            keys = tl.load(k_cache_ptr + slot[:, None] * stride_kc + kv_head * stride_kh + offs_d[None, :],
                           mask=mask_d[None, :], other=0.0)
            values = tl.load(v_cache_ptr + slot[:, None] * stride_vc + kv_head * stride_vh + offs_d[None, :],
                             mask=mask_d[None, :], other=0.0)
    s = _dot(q, tl.trans(keys), PRECISION) * qk_scale  # [BM, BN], log2 units
    if MASKED:
        s = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite: every row has seen a key by its first tile
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, PRECISION)
    return m_new, l, acc


@triton.jit
def _fa_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, kv_indices_ptr, kv_indptr_ptr, cu_seqlens_ptr, o_ptr,
    stride_qt, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh, stride_ot, stride_oh,
    qk_scale, max_seqlen, seq_bucket,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
):
    head = tl.program_id(0)
    q_block = tl.cdiv(max_seqlen, BLOCK_M) - 1 - tl.program_id(1)  # latest blocks (most keys) first
    seq = tl.program_id(2)
    kv_head = head // GROUP
    q_start, n_new, ctx_start, ctx_len = _prefill_sequence(cu_seqlens_ptr, kv_indptr_ptr, seq)
    if q_block * BLOCK_M >= n_new:
        return
    q, offs_m, offs_d, mask_m, mask_d, q_pos = _load_query_block(
        q_ptr, k_cache_ptr, stride_qt, stride_qh, head, q_start, n_new, ctx_len, q_block, D, BLOCK_M, BLOCK_D)

    first_pos = ctx_len - n_new + q_block * BLOCK_M  # the block's first row: it sees keys ..= first_pos
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # tiles below it: every row sees every key
    kv_end = tl.minimum(ctx_len, first_pos + BLOCK_M)  # past the block's last row: nobody looks
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    EVEN_D: tl.constexpr = D == BLOCK_D
    if LOOP_AS_WHILE:
        n0 = 0
        while n0 < full_end:
            m, l, acc = _tile(q, m, l, acc, n0, q_pos, kv_end, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start,
                              kv_head, stride_kc, stride_kh, stride_vc, stride_vh, qk_scale, offs_d, mask_d,
                              False, EVEN_D, BLOCK_N, PRECISION)
            n0 += BLOCK_N
        while n0 < kv_end:
            m, l, acc = _tile(q, m, l, acc, n0, q_pos, kv_end, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start,
                              kv_head, stride_kc, stride_kh, stride_vc, stride_vh, qk_scale, offs_d, mask_d,
                              True, EVEN_D, BLOCK_N, PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(0, full_end, BLOCK_N):
            m, l, acc = _tile(q, m, l, acc, n0, q_pos, kv_end, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start,
                              kv_head, stride_kc, stride_kh, stride_vc, stride_vh, qk_scale, offs_d, mask_d,
                              False, EVEN_D, BLOCK_N, PRECISION)
        for n0 in range(full_end, kv_end, BLOCK_N):
            m, l, acc = _tile(q, m, l, acc, n0, q_pos, kv_end, k_cache_ptr, v_cache_ptr, kv_indices_ptr, ctx_start,
                              kv_head, stride_kc, stride_kh, stride_vc, stride_vh, qk_scale, offs_d, mask_d,
                              True, EVEN_D, BLOCK_N, PRECISION)
    out = acc / l[:, None]
    tl.store(o_ptr + (q_start + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


_fa_prefill_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps,
                           num_stages=c.num_stages) for c in AUTOTUNE],
    key=["D", "GROUP", "seq_bucket"],
)(_fa_prefill_kernel)


def attention_prefill_fa(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *, out=None,
                         max_seqlen: int | None = None, launch: FaLaunch | None = None):
    """Causal varlen attention; each sequence's new tokens are the last of its context.

    q [T, H, d] → o [T, H, d] in q.dtype. `launch` None: autotuned on CUDA (AUTOTUNE), else
    FaLaunch(). `max_seqlen` as in `attention_prefill` (None: one device sync)."""
    T, H, d = q.shape
    H_kv = k_cache.shape[1]
    B = cu_seqlens.numel() - 1
    o = torch.empty_like(q) if out is None else out
    if T == 0 or B == 0:
        return o
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1 and o.stride(-1) == 1
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    args = (q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, o,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            o.stride(0), o.stride(1), scale * LOG2E, max_seqlen, min(triton.next_power_of_2(max_seqlen), 8192))
    consts = dict(GROUP=H // H_kv, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                  PRECISION="ieee" if q.dtype == torch.float32 else "tf32", LOOP_AS_WHILE=LOOP_AS_WHILE)
    if launch is None and q.is_cuda:
        grid = lambda meta: (H, triton.cdiv(max_seqlen, meta["BLOCK_M"]), B)  # noqa: E731
        _fa_prefill_tuned[grid](*args, **consts)
    else:
        c = launch or FaLaunch()
        _fa_prefill_kernel[(H, triton.cdiv(max_seqlen, c.block_m), B)](
            *args, **consts, BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages)
    return o
