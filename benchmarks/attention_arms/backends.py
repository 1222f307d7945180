"""A prefill batch under any PrefillPolicy (benchmarks/attention_arms/policy.py): the packed
`varlen_attn` and FA2-style calls and the per-sequence SDPA calls of every backend and prefix
mask, on the model's segment runner (kernels/attention/prefill.py's PrefillBatch; a backend that
raises is recorded in its `_REFUSED` and its runs go to Triton from then on)."""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from batchinfer.kernels.attention import attention as triton_attention
from batchinfer.kernels.attention import prefill
from benchmarks.attention_arms.policy import PACKED_BACKENDS, SDPA_BACKENDS, PrefillPolicy, plan_segments

# A packed backend: (q [T,H,d], k [Σctx,H_kv,d], v, cu_q [B+1], cu_k [B+1], max_q, max_k, scale) → o [T,H,d].
PackedFn = Callable[..., torch.Tensor]
# A per-sequence backend: (q [n,H,d], k [ctx,H_kv,d], v, scale, policy) → o [n,H,d].
SequenceFn = Callable[..., torch.Tensor]


def _varlen_kwargs(fn: Callable) -> dict:
    """Causal (bottom-right) + GQA keywords of this torch's varlen_attn: is_causal (2.9),
    window_size (-1, 0) from 2.10, enable_gqa where it exists (flash takes GQA natively)."""
    params = inspect.signature(fn).parameters
    kwargs: dict = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def run_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    kwargs = _varlen_kwargs(varlen_attn)
    if "scale" in inspect.signature(varlen_attn).parameters:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError("this torch's varlen_attn has no scale argument and the scale is not 1/sqrt(d)")
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def causal_mask(n: int, ctx: int, device) -> torch.Tensor:
    """Bool [n, ctx]: query j (context position ctx - n + j) sees keys 0 ..= its position."""
    return torch.arange(ctx, device=device)[None, :] <= (ctx - n + torch.arange(n, device=device))[:, None]


def run_sdpa(backend: str, q, k, v, scale: float, policy: PrefillPolicy) -> torch.Tensor:
    """One long run through SDPA pinned to `backend`: q [n, H, d] over k, v [ctx, H_kv, d] → [n, H, d]."""
    from torch.nn.attention.bias import causal_lower_right

    n, ctx = q.shape[0], k.shape[0]
    q4, k4, v4 = prefill.heads_first(q), prefill.heads_first(k), prefill.heads_first(v)
    kwargs: dict = {"scale": scale}
    if policy.repeat_kv:
        group = q.shape[1] // k.shape[1]
        k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)  # [1, H, ctx, d]
    else:
        kwargs["enable_gqa"] = True
    if n != ctx and policy.prefix_mask == "split":
        o = prefill.split_or_none(q4, k4, v4, scale)
        if o is not None:
            return o
    if n == ctx:
        kwargs["is_causal"] = True
    elif policy.prefix_mask == "dense":
        kwargs["attn_mask"] = causal_mask(n, ctx, q.device)
    else:  # lower_right, or a refused split
        kwargs["attn_mask"] = causal_lower_right(n, ctx)
    return prefill.sdpa(q4, k4, v4, SDPA_BACKENDS[backend], **kwargs)


def attention_prefill_under(policy: PrefillPolicy, q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *,
                            out=None, max_seqlen: int | None = None) -> torch.Tensor:
    """The model's `attention_prefill` with `policy`'s backend taking the long runs where it can
    run (CUDA, bf16/fp16), everything else the Triton kernel."""
    if policy.backend == "triton" or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return prefill.attention_prefill_triton(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale,
                                                out=out, max_seqlen=max_seqlen)
    return attention_prefill_with(policy, q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, out=out)


def attention_prefill_with(policy: PrefillPolicy, q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale,
                           *, out=None, packed_fn: PackedFn = run_varlen, sequence_fn: SequenceFn | None = None,
                           short_fn: Callable = triton_attention.attention_prefill) -> torch.Tensor:
    """The model's `attention_prefill` under `policy`, without the device / dtype check: the
    backends are parameters (`packed_fn` for varlen, `sequence_fn` for the SDPA ones, `short_fn`
    for the short runs) so that CPU tests can put the reference in their place."""
    from benchmarks.attention_arms.prefill_fa import attention_prefill_fa

    o = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0 or cu_seqlens.numel() < 2:
        return o
    batch = prefill.PrefillBatch.of(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, o)
    if sequence_fn is None:
        sequence_fn = lambda q_i, k_i, v_i, scale_, policy_: run_sdpa(policy.backend, q_i, k_i, v_i, scale_, policy_)  # noqa: E731
    for seg in plan_segments(batch.new_lens, policy):
        if batch.cu[seg.lo] == batch.cu[seg.hi]:
            continue
        if seg.kind == "triton" or policy.backend in prefill._REFUSED:  # a refused backend: Triton from then on
            batch.run_short(seg, short_fn)
        elif policy.backend == "triton-fa":
            attention_prefill_fa(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, out=o,
                                 max_seqlen=max(batch.new_lens))
        elif policy.backend in PACKED_BACKENDS:
            k_ctx, v_ctx = batch.context(seg)
            ctx_lens = [b - a for a, b in zip(batch.indptr, batch.indptr[1:])]
            o.copy_(packed_fn(q, k_ctx, v_ctx, cu_seqlens.to(torch.int32), kv_indptr.to(torch.int32),
                              max(batch.new_lens), max(ctx_lens), scale))
        else:
            batch.run_sequence(seg, policy.backend,
                               lambda q_i, k_i, v_i, scale_: sequence_fn(q_i, k_i, v_i, scale_, policy), short_fn)
    return o
