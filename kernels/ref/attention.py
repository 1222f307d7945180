"""Plain-torch reference for attention over a token-granular KV pool (docs/MODULES.md).

Sequence i's context is `kv_indices[kv_indptr[i]:kv_indptr[i+1]]` (cached prefix, then
its new tokens, already stored). fp32 math through torch SDPA, one call per sequence;
output in q.dtype. GQA: query head h reads KV head h // (H / H_kv).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


FP8_KV_DTYPES = (torch.float8_e4m3fn,)  # KV pools stored in FP8 (EngineConfig.kv_cache_dtype)


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a KV pool's dtype. FP8 has no scale here (1.0, as the peers' default without
    calibrated scales) and saturates at its largest finite value: a plain cast overflows to NaN."""
    if dtype in FP8_KV_DTYPES:
        top = torch.finfo(dtype).max
        return x.clamp(-top, top).to(dtype)
    return x.to(dtype)


def store_kv(k, v, k_cache, v_cache, out_slots) -> None:
    """Scatter new keys/values [T, H_kv, d] into the pools [S_kv, H_kv, d] at out_slots [T]."""
    slots = out_slots.long()
    for new, pool in ((k, k_cache), (v, v_cache)):
        rows = to_pool_dtype(new, pool.dtype)
        if pool.dtype in FP8_KV_DTYPES:  # index_copy_ has no FP8 kernel on the CPU: copy the bytes
            pool, rows = pool.view(torch.uint8), rows.view(torch.uint8)
        # index_copy_ rather than advanced indexing: much cheaper on CPU.
        pool.index_copy_(0, slots, rows)


def _gather_context(k_cache, v_cache, idx, n_heads: int):
    """Context keys/values of one sequence in SDPA layout, KV heads expanded. → [H, ctx, d]."""
    keys = k_cache.index_select(0, idx).float().transpose(0, 1)  # [H_kv, ctx, d]
    values = v_cache.index_select(0, idx).float().transpose(0, 1)  # [H_kv, ctx, d]
    group = n_heads // keys.shape[0]
    return keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)


def attention_prefill(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale):
    """Causal varlen attention; the new tokens are the last positions of each context.

    q [T, H, d]; returns o [T, H, d] in q.dtype.
    """
    out = torch.full_like(q, float("nan"))
    indptr = kv_indptr.tolist()
    seq_bounds = cu_seqlens.tolist()
    n_heads = q.shape[1]
    for i in range(len(seq_bounds) - 1):
        q_start, q_end = seq_bounds[i], seq_bounds[i + 1]
        n_new = q_end - q_start
        if n_new == 0:
            continue
        idx = kv_indices[indptr[i]:indptr[i + 1]].long()
        ctx = idx.numel()
        keys, values = _gather_context(k_cache, v_cache, idx, n_heads)
        # Query j sits at context position ctx - n_new + j and sees keys 0..that position.
        q_pos = torch.arange(ctx - n_new, ctx, device=q.device)[:, None]  # [n_new, 1]
        visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # [n_new, ctx]
        queries = q[q_start:q_end].float().transpose(0, 1)  # [H, n_new, d]
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=scale)
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


def attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale, *, shared_with_prev=None):
    """One query per sequence over its whole context. q [B, H, d] → o [B, H, d] in q.dtype.

    `shared_with_prev` [B] (optional) is only a speed hint for the Triton kernel (row r's first
    `shared_with_prev[r]` slots equal row r-1's): the maths ignores it, but a broken promise
    raises here, so that CPU runs catch a caller's wrong hint.
    """
    out = torch.full_like(q, float("nan"))
    indptr = kv_indptr.tolist()
    if shared_with_prev is not None:
        _check_shared_hint(kv_indices, indptr, shared_with_prev.tolist())
    n_heads = q.shape[1]
    for i in range(q.shape[0]):
        idx = kv_indices[indptr[i]:indptr[i + 1]].long()
        keys, values = _gather_context(k_cache, v_cache, idx, n_heads)
        queries = q[i].float()[:, None, :]  # [H, 1, d]
        o = F.scaled_dot_product_attention(queries, keys, values, scale=scale)
        out[i] = o[:, 0].to(q.dtype)
    return out


def _check_shared_hint(kv_indices, indptr: list[int], shared: list[int]) -> None:
    for r in range(1, len(shared)):
        n = shared[r]
        if n <= 0:
            continue
        if n > indptr[r + 1] - indptr[r] or n > indptr[r] - indptr[r - 1]:
            raise ValueError(f"shared_with_prev[{r}] = {n} exceeds a context length")
        if not torch.equal(kv_indices[indptr[r]:indptr[r] + n], kv_indices[indptr[r - 1]:indptr[r - 1] + n]):
            raise ValueError(f"shared_with_prev[{r}] = {n}: rows {r - 1} and {r} differ in their first {n} slots")
