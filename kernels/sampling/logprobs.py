"""Triton kernel of `row_logprobs` (contract: kernels/sampling/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_NO_ID = tl.constexpr(2147483647)


@dataclass(frozen=True)
class LogprobsLaunch:
    block_v: int = 2048
    num_warps: int = 8


@triton.jit
def _row_logprobs_kernel(logits_ptr, stride_row, rows_ptr, tokens_ptr, out_ptr, V, K: tl.constexpr,
                         KP: tl.constexpr, V_BLOCKS: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)
    base = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK_V)
    slots = tl.arange(0, KP)
    # The running top-K: real slots start at -inf; padding slots (>= K) at +inf are never replaced.
    top_v = tl.where(slots < K, float("-inf"), float("inf"))
    top_i = tl.full([KP], _NO_ID, tl.int32)
    m = tl.full([], float("-inf"), tl.float32)  # online logsumexp: running max and sum of exp(x - m)
    s = tl.full([], 0.0, tl.float32)
    for b in range(V_BLOCKS):  # constexpr trip count: the interpreter cannot loop to a runtime int
        v = b * BLOCK_V + lanes
        x = tl.load(base + v, mask=v < V, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        finite = m_new > float("-inf")  # a block of only -inf adds nothing (and no NaN)
        s = tl.where(finite, s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0), s)
        m = m_new
        cand = x
        for _ in tl.static_range(K):  # the block's best K, each kept if it beats the running worst
            best = tl.max(cand, axis=0)
            best_id = tl.min(tl.where(cand == best, v, _NO_ID), axis=0)
            worst = tl.min(top_v, axis=0)
            worst_slot = tl.min(tl.where(top_v == worst, slots, KP), axis=0)
            replace = slots == tl.where(best > worst, worst_slot, KP)  # KP: no slot
            top_v = tl.where(replace, best, top_v)
            top_i = tl.where(replace, best_id, top_i)
            cand = tl.where(v == best_id, float("-inf"), cand)
    lse = m + tl.log(s)
    token = tl.load(tokens_ptr + row)
    out = out_ptr + r * (1 + 2 * K)
    tl.store(out, tl.load(base + token) - lse)
    top_v = tl.where(slots < K, top_v, float("-inf"))  # padding out of the way
    for j in tl.static_range(K):  # descending; equal values: the lower id first
        best = tl.max(top_v, axis=0)
        best_id = tl.min(tl.where(top_v == best, top_i, _NO_ID), axis=0)
        tl.store(out + 1 + j, best - lse)
        tl.store(out + 1 + K + j, best_id.to(tl.float32, bitcast=True))
        top_v = tl.where(top_i == best_id, float("-inf"), top_v)


def row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, k: int,
                 launch: LogprobsLaunch | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] fp32 (unit column stride), tokens [N] int64, rows [R] int64, k >= 0 →
    [R, 1 + 2k] fp32 (into `out` when given): `batchinfer.engine.sampler.token_logprobs`' packing."""
    launch = launch or LogprobsLaunch()
    assert logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32
    V = logits.shape[1]
    if out is None:
        out = torch.empty(rows.numel(), 1 + 2 * k, dtype=torch.float32, device=logits.device)
    assert out.shape == (rows.numel(), 1 + 2 * k) and out.is_contiguous()
    if rows.numel():
        _row_logprobs_kernel[(rows.numel(),)](
            logits, logits.stride(0), rows.contiguous(), tokens.contiguous(), out, V, K=k,
            KP=max(1, triton.next_power_of_2(k)), V_BLOCKS=triton.cdiv(V, launch.block_v),
            BLOCK_V=launch.block_v, num_warps=launch.num_warps)
    return out
