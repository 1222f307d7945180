"""Prefill attention with a selectable backend for long runs of new tokens (contract: docs/MODULES.md
`attention_prefill`; reference: kernels/ref/attention.py).

Long prompts spend most of their attention time in a few long causal runs, where Hopper-class
kernels behind torch (FlashAttention-2 through `varlen_attn`, cuDNN / flash / memory-efficient
through SDPA) beat our Triton kernel; many short runs are better served by the Triton kernel,
which reads K/V straight from the pool. `PREFILL_POLICY` says which backend takes the long runs
(`"triton"`: none, the plain kernel does everything) and from which run length on:

- `varlen`: when the batch's longest new run reaches `min_run`, the whole batch is one packed
  `varlen_attn` call over K/V gathered from the pool (flash's causal mask is bottom-right
  aligned, so a cached prefix needs nothing extra; GQA is native).
- `triton-fa`: the same batches to kernels/attention_prefill_fa.py (FA2-style, autotuned,
  reads the pool through the slot table: no gather).
- `sdpa-<cudnn|flash|efficient>`: each sequence whose run reaches `min_run` is one SDPA call
  ([1, H, n, d] over its gathered [1, H_kv, ctx, d]; `is_causal` without a cached prefix, else
  the policy's `prefix_mask`), the consecutive short sequences between them one Triton call
  each over their slice of the batch. After a cached prefix, cuDNN's default is "split": torch's
  lower-right CausalBias never dispatches to cuDNN (it calls flash or memory-efficient, or
  materialises the mask), so the run is two cuDNN calls, its queries over the prefix (no mask)
  and over its own keys (`is_causal`), merged by their log-sum-exps (`merge_by_lse`).

The backend paths need host-side lengths: one device sync per batch, shared by all layers of a
step (`host_lengths` caches the last batch's; the Triton-only path needs it only for
`max_seqlen`). Off CUDA, or for dtypes the fused kernels lack (fp32), the Triton kernel runs.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from batchinfer.kernels.attention import attention as triton_attention
from batchinfer.kernels.attention.prefill_fa import attention_prefill_fa

log = logging.getLogger(__name__)
PACKED_BACKENDS = ("varlen", "triton-fa")
SDPA_BACKENDS = {"sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-flash": "FLASH_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}
BACKENDS = ("triton",) + PACKED_BACKENDS + tuple(SDPA_BACKENDS)
PREFIX_MASKS = ("lower_right", "dense", "split")


@dataclass(frozen=True)
class PrefillPolicy:
    """Which backend takes the long new-token runs of a prefill batch.

    backend: one of BACKENDS. min_run: a run of at least this many new tokens is long.
    repeat_kv: expand KV heads to the query heads before SDPA (for a backend refusing
    enable_gqa). prefix_mask: how SDPA masks a run after a cached prefix, "lower_right"
    (CausalBias), "dense" (a bool [n, ctx] mask) or "split" (prefix and own keys as two calls
    merged by log-sum-exp; sdpa-cudnn only)."""

    backend: str = "triton"
    min_run: int = 1024
    repeat_kv: bool = False
    prefix_mask: str = "lower_right"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"prefill attention backend {self.backend!r}; one of {', '.join(BACKENDS)}")
        if self.prefix_mask not in PREFIX_MASKS:
            raise ValueError(f"prefix_mask {self.prefix_mask!r}; one of {', '.join(PREFIX_MASKS)}")
        if self.prefix_mask == "split" and self.backend != "sdpa-cudnn":
            raise ValueError("prefix_mask 'split' needs the sdpa-cudnn backend (the one whose log-sum-exp it reads)")


# The model's prefill: cuDNN's fused attention for runs of >= 1,024 new tokens, measured ahead of
# the Triton kernel at 8k / 32k context on the H200 (docs/BENCHMARKS.md, "Long prompts without
# sharing"); after a cached prefix (the later chunks of a long prompt) as the split pair of cuDNN
# calls; where cuDNN refuses (another GPU, another torch) the Triton kernel runs instead.
DEFAULT_POLICY = PrefillPolicy("sdpa-cudnn", min_run=1024, prefix_mask="split")
PREFILL_POLICY = DEFAULT_POLICY
_REFUSED: set[str] = set()  # SDPA backends that raised once here: their runs go to Triton from then on


@contextlib.contextmanager
def prefill_policy(policy: PrefillPolicy) -> Iterator[None]:
    """Run the block with `policy` in place of PREFILL_POLICY (benchmarks, tests)."""
    global PREFILL_POLICY
    previous, PREFILL_POLICY = PREFILL_POLICY, policy
    try:
        yield
    finally:
        PREFILL_POLICY = previous


@dataclass(frozen=True)
class Segment:
    """Sequences [lo, hi) of the batch, run by `kind` ("triton" or "backend")."""

    kind: str
    lo: int
    hi: int


def plan_segments(new_lens: list[int], policy: PrefillPolicy) -> list[Segment]:
    """Split a batch (new-token run lengths, in batch order) into the calls that run it."""
    B = len(new_lens)
    if B == 0:
        return []
    if policy.backend == "triton" or max(new_lens) < policy.min_run:
        return [Segment("triton", 0, B)]
    if policy.backend in PACKED_BACKENDS:
        return [Segment("backend", 0, B)]
    segments: list[Segment] = []
    short_from = None  # first sequence of the current run of short sequences
    for i, n in enumerate(new_lens):
        if n >= policy.min_run:
            if short_from is not None:
                segments.append(Segment("triton", short_from, i))
                short_from = None
            segments.append(Segment("backend", i, i + 1))
        elif short_from is None:
            short_from = i
    if short_from is not None:
        segments.append(Segment("triton", short_from, B))
    return segments


def _version(t: torch.Tensor) -> int:
    """The in-place version counter; inference tensors (the engine's) have none: -1. The engine
    builds the step's length tensors afresh, so the held ids alone identify them."""
    return -1 if t.is_inference() else t._version


class _HostLengths:
    """The last batch's (cu_seqlens, kv_indptr) on the host: every attention layer of a step
    passes the same two tensors, so only the first pays the device sync. Holding the tensors
    keeps their ids from being reused; `_version` catches an in-place rewrite."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._held: tuple = ()
        self._value: tuple[list[int], list[int]] = ([], [])

    def get(self, cu_seqlens: torch.Tensor, kv_indptr: torch.Tensor) -> tuple[list[int], list[int]]:
        key = (id(cu_seqlens), _version(cu_seqlens), id(kv_indptr), _version(kv_indptr))
        if key != self._key:
            both = torch.cat([cu_seqlens.to(torch.int64), kv_indptr.to(torch.int64)]).tolist()  # one sync
            n = cu_seqlens.numel()
            self._key, self._held, self._value = key, (cu_seqlens, kv_indptr), (both[:n], both[n:])
        return self._value


host_lengths = _HostLengths()

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


def run_sdpa(backend: str, q, k, v, scale: float, policy: PrefillPolicy) -> torch.Tensor:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    n, ctx = q.shape[0], k.shape[0]
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
    k4 = k.transpose(0, 1).unsqueeze(0)  # [1, H_kv, ctx, d]
    v4 = v.transpose(0, 1).unsqueeze(0)
    kwargs: dict = {"scale": scale}
    if policy.repeat_kv:
        group = q.shape[1] // k.shape[1]
        k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)  # [1, H, ctx, d]
    else:
        kwargs["enable_gqa"] = True
    if n != ctx and policy.prefix_mask == "split" and "split" not in _REFUSED:
        try:
            attend = cudnn_attend if q.is_cuda else math_attend
            return split_prefix_attention(q4, k4, v4, scale, attend)[0].transpose(0, 1)  # [n, H, d]
        except RuntimeError as error:  # this torch / cuDNN lacks the op or a layout: lower-right below
            _REFUSED.add("split")
            log.warning("prefill attention: cuDNN split refused (%s); lower-right CausalBias instead",
                        str(error).splitlines()[0] if str(error) else type(error).__name__)
    if n == ctx:
        kwargs["is_causal"] = True
    elif policy.prefix_mask == "dense":
        kwargs["attn_mask"] = causal_mask(n, ctx, q.device)
    else:  # lower_right, or a refused split
        kwargs["attn_mask"] = causal_lower_right(n, ctx)
    with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):
        o = F.scaled_dot_product_attention(q4, k4, v4, **kwargs)  # [1, H, n, d]
    return o[0].transpose(0, 1)  # [n, H, d]


# (q [1, H, n, d], k [1, H_kv, m, d], v, scale, causal) → (o [1, H, n, d] in q.dtype, lse [1, H, n] fp32):
# attention with its natural-log log-sum-exp; `causal` is top-left (only used with n == m).
AttendWithLse = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def cudnn_attend(q4, k4, v4, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention with its log-sum-exp (torch's private op: the public SDPA drops it)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q4.shape[:3]).float()


def math_attend(q4, k4, v4, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference of `cudnn_attend` (CPU, tests)."""
    group = q4.shape[1] // k4.shape[1]
    k, v = k4.repeat_interleave(group, 1).float(), v4.repeat_interleave(group, 1).float()  # [1, H, m, d]
    scores = q4.float() @ k.transpose(-1, -2) * scale  # [1, H, n, m]
    if causal:
        n, m = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q4.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [1, H, n]
    return (torch.softmax(scores, dim=-1) @ v).to(q4.dtype), lse


def merge_by_lse(o1, lse1, o2, lse2) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key sets from each set's (o [.., n, d], lse [.., n]):
    o = Σ o_i · exp(lse_i − lse), lse = logaddexp(lse1, lse2); in fp32, returned in o1's dtype
    (an fp32 o1 or o2 is scaled in place)."""
    lse = torch.logaddexp(lse1, lse2)
    merged = o1.float().mul_(torch.exp(lse1 - lse).unsqueeze(-1))
    merged.add_(o2.float().mul_(torch.exp(lse2 - lse).unsqueeze(-1)))
    return merged.to(o1.dtype), lse


def split_prefix_attention(q4, k4, v4, scale: float, attend: AttendWithLse) -> torch.Tensor:
    """Lower-right causal attention of n queries over ctx keys (the last n are theirs) as two
    `attend` calls, the cached prefix unmasked and the own keys causal, merged: both run in
    cuDNN's fused kernel, which the lower-right mask cannot reach. → o [1, H, n, d]."""
    n, ctx = q4.shape[2], k4.shape[2]
    cached = ctx - n
    o_prefix, lse_prefix = attend(q4, k4[:, :, :cached], v4[:, :, :cached], scale, False)
    o_own, lse_own = attend(q4, k4[:, :, cached:], v4[:, :, cached:], scale, True)
    return merge_by_lse(o_prefix, lse_prefix, o_own, lse_own)[0]


def causal_mask(n: int, ctx: int, device) -> torch.Tensor:
    """Bool [n, ctx]: query j (context position ctx - n + j) sees keys 0 ..= its position."""
    return torch.arange(ctx, device=device)[None, :] <= (ctx - n + torch.arange(n, device=device))[:, None]


def attention_prefill(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *, out=None,
                      max_seqlen: int | None = None):
    """Causal varlen attention; each sequence's new tokens are the last of its context.

    q [T, H, d] → o [T, H, d] in q.dtype (docs/MODULES.md). Long runs go to PREFILL_POLICY's
    backend where it can run (CUDA, bf16/fp16), everything else to the Triton kernel."""
    policy = PREFILL_POLICY
    if policy.backend == "triton" or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        if max_seqlen is None and q.is_cuda and cu_seqlens.numel() > 1:
            cu, _ = host_lengths.get(cu_seqlens, kv_indptr)  # one sync per batch, not per layer
            max_seqlen = max(b - a for a, b in zip(cu, cu[1:]))
        return triton_attention.attention_prefill(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale,
                                                  out=out, max_seqlen=max_seqlen)
    return attention_prefill_with(policy, q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, out=out)


def attention_prefill_with(policy: PrefillPolicy, q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale,
                           *, out=None, packed_fn: PackedFn = run_varlen, sequence_fn: SequenceFn | None = None,
                           short_fn: Callable = triton_attention.attention_prefill) -> torch.Tensor:
    """`attention_prefill` under `policy`, without the device / dtype check: the backends are
    parameters (`packed_fn` for varlen, `sequence_fn` for the SDPA ones, `short_fn` for the
    short runs) so that CPU tests can put the reference in their place."""
    T = q.shape[0]
    o = torch.empty_like(q) if out is None else out
    B = cu_seqlens.numel() - 1
    if T == 0 or B == 0:
        return o
    cu, indptr = host_lengths.get(cu_seqlens, kv_indptr)
    new_lens = [cu[i + 1] - cu[i] for i in range(B)]
    if sequence_fn is None and policy.backend in SDPA_BACKENDS:
        def sequence_fn(q_i, k_i, v_i, scale_, policy_):
            return run_sdpa(policy.backend, q_i, k_i, v_i, scale_, policy_)
    def run_short(seg: Segment) -> None:
        t0, t1, c0 = cu[seg.lo], cu[seg.hi], indptr[seg.lo]
        whole = seg.lo == 0 and seg.hi == B
        # A slice of the batch: its tokens and context slots start at t0 / c0, so its
        # boundary tables are the batch's shifted by those.
        short_fn(q[t0:t1], k_cache, v_cache, kv_indices if whole else kv_indices[c0:indptr[seg.hi]],
                 kv_indptr if whole else kv_indptr[seg.lo:seg.hi + 1] - c0,
                 cu_seqlens if whole else cu_seqlens[seg.lo:seg.hi + 1] - t0, scale,
                 out=o[t0:t1], max_seqlen=max(new_lens[seg.lo:seg.hi]))

    for seg in plan_segments(new_lens, policy):
        t0, t1, c0, c1 = cu[seg.lo], cu[seg.hi], indptr[seg.lo], indptr[seg.hi]
        if t0 == t1:
            continue
        if seg.kind == "triton" or policy.backend in _REFUSED:  # a refused backend: Triton from then on
            run_short(seg)
            continue
        if policy.backend == "triton-fa":
            attention_prefill_fa(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, out=o,
                                 max_seqlen=max(new_lens))
            continue
        idx = kv_indices[c0:c1]
        k_ctx, v_ctx = k_cache.index_select(0, idx), v_cache.index_select(0, idx)  # [ctx, H_kv, d]
        if policy.backend in PACKED_BACKENDS:
            ctx_lens = [indptr[i + 1] - indptr[i] for i in range(B)]
            o.copy_(packed_fn(q, k_ctx, v_ctx, cu_seqlens.to(torch.int32), kv_indptr.to(torch.int32),
                              max(new_lens), max(ctx_lens), scale))
            continue
        try:
            o[t0:t1].copy_(sequence_fn(q[t0:t1], k_ctx, v_ctx, scale, policy))
        except RuntimeError as error:  # e.g. "No available kernel": this GPU / torch lacks the backend
            _REFUSED.add(policy.backend)
            log.warning("prefill attention: %s refused (%s); the Triton kernel runs instead",
                        policy.backend, str(error).splitlines()[0] if str(error) else type(error).__name__)
            run_short(seg)
    return o
