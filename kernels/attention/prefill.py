"""The model's prefill attention (contract: docs/MODULES.md `attention_prefill`; reference:
kernels/ref/attention.py): cuDNN's fused attention for long runs of new tokens, the Triton kernel
for everything else.

Long prompts spend most of their attention time in a few long causal runs, where cuDNN's fused
kernel behind torch's SDPA beats our Triton kernel; many short runs are better served by the
Triton kernel, which reads K/V straight from the pool. Each sequence whose run reaches MIN_RUN new
tokens is one SDPA call ([1, H, n, d] over its gathered [1, H_kv, ctx, d]; `is_causal` without a
cached prefix), the consecutive short sequences between them one Triton call each over their
slice of the batch. After a cached prefix the run is two cuDNN calls, its queries over the prefix
(no mask) and over its own keys (`is_causal`), merged by their log-sum-exps (`merge_by_lse`):
torch's lower-right CausalBias never dispatches to cuDNN. Where cuDNN refuses (another GPU,
another torch) the refusal is recorded in `_REFUSED` and the Triton kernel runs from then on.
Measured in docs/BENCHMARKS.md, "Long prompts without sharing"; the other backends it was
measured against live in benchmarks/attention_arms/.

The long-run path needs host-side lengths: one device sync per batch, shared by all layers of a
step (`host_lengths` caches the last batch's; the Triton-only path needs it only for
`max_seqlen`). Off CUDA, or for dtypes the fused kernel lacks (fp32), the Triton kernel runs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from batchinfer.kernels.attention import attention as triton_attention

log = logging.getLogger(__name__)
MIN_RUN = 1024  # new tokens from which a run goes to cuDNN (measured at 8k / 32k context on the H200)
_REFUSED: set[str] = set()  # backends (and "split") that raised once here: their runs go elsewhere from then on


@dataclass(frozen=True)
class Segment:
    """Sequences [lo, hi) of the batch, run by `kind` ("triton" or "backend")."""

    kind: str
    lo: int
    hi: int


def plan_segments(new_lens: list[int], min_run: int = MIN_RUN) -> list[Segment]:
    """Split a batch (new-token run lengths, in batch order) into one call per long run and one
    Triton call per stretch of short runs."""
    B = len(new_lens)
    if B == 0:
        return []
    if max(new_lens) < min_run:
        return [Segment("triton", 0, B)]
    segments: list[Segment] = []
    short_from = None  # first sequence of the current run of short sequences
    for i, n in enumerate(new_lens):
        if n >= min_run:
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

# A per-sequence backend: (q [n,H,d], k [ctx,H_kv,d], v, scale) → o [n,H,d].
SequenceFn = Callable[..., torch.Tensor]
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


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """[n, H, d] → [1, H, n, d], SDPA's layout."""
    return t.transpose(0, 1).unsqueeze(0)


def split_or_none(q4, k4, v4, scale: float) -> Optional[torch.Tensor]:
    """`split_prefix_attention` in cuDNN (`math_attend` off CUDA) → o [n, H, d]; None where the
    split was refused, now (recorded, logged) or before."""
    if "split" in _REFUSED:
        return None
    try:
        attend = cudnn_attend if q4.is_cuda else math_attend
        return split_prefix_attention(q4, k4, v4, scale, attend)[0].transpose(0, 1)  # [n, H, d]
    except RuntimeError as error:  # this torch / cuDNN lacks the op or a layout: lower-right instead
        _REFUSED.add("split")
        log.warning("prefill attention: cuDNN split refused (%s); lower-right CausalBias instead", _first_line(error))
        return None


def sdpa(q4, k4, v4, backend: str, **kwargs) -> torch.Tensor:
    """torch's SDPA pinned to `backend` (an SDPBackend name) → o [n, H, d]."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        o = F.scaled_dot_product_attention(q4, k4, v4, **kwargs)  # [1, H, n, d]
    return o[0].transpose(0, 1)


def run_cudnn(q, k, v, scale: float) -> torch.Tensor:
    """One long run in cuDNN: q [n, H, d] over its context k, v [ctx, H_kv, d] → o [n, H, d]."""
    from torch.nn.attention.bias import causal_lower_right

    n, ctx = q.shape[0], k.shape[0]
    q4, k4, v4 = heads_first(q), heads_first(k), heads_first(v)
    if n != ctx:
        o = split_or_none(q4, k4, v4, scale)
        if o is not None:
            return o
    mask = {"is_causal": True} if n == ctx else {"attn_mask": causal_lower_right(n, ctx)}
    return sdpa(q4, k4, v4, "CUDNN_ATTENTION", scale=scale, enable_gqa=True, **mask)


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


@dataclass(frozen=True)
class PrefillBatch:
    """One prefill call's inputs, output and host-side lengths, run segment by segment."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    cu_seqlens: torch.Tensor
    scale: float
    o: torch.Tensor
    cu: list[int]  # cu_seqlens on the host
    indptr: list[int]  # kv_indptr on the host
    new_lens: list[int]

    @classmethod
    def of(cls, q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, o) -> "PrefillBatch":
        cu, indptr = host_lengths.get(cu_seqlens, kv_indptr)
        new_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        return cls(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, o, cu, indptr, new_lens)

    def run_short(self, seg: Segment, short_fn: Callable) -> None:
        """Sequences [seg.lo, seg.hi) in one `short_fn` call (the Triton kernel's signature)."""
        B = len(self.new_lens)
        t0, t1, c0 = self.cu[seg.lo], self.cu[seg.hi], self.indptr[seg.lo]
        whole = seg.lo == 0 and seg.hi == B
        # A slice of the batch: its tokens and context slots start at t0 / c0, so its
        # boundary tables are the batch's shifted by those.
        short_fn(self.q[t0:t1], self.k_cache, self.v_cache,
                 self.kv_indices if whole else self.kv_indices[c0:self.indptr[seg.hi]],
                 self.kv_indptr if whole else self.kv_indptr[seg.lo:seg.hi + 1] - c0,
                 self.cu_seqlens if whole else self.cu_seqlens[seg.lo:seg.hi + 1] - t0, self.scale,
                 out=self.o[t0:t1], max_seqlen=max(self.new_lens[seg.lo:seg.hi]))

    def context(self, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [ctx, H_kv, d] of sequences [seg.lo, seg.hi), gathered from the pool."""
        idx = self.kv_indices[self.indptr[seg.lo]:self.indptr[seg.hi]]
        # An FP8 pool is widened to the queries' dtype (the backends take one dtype).
        return self.k_cache.index_select(0, idx).to(self.q.dtype), self.v_cache.index_select(0, idx).to(self.q.dtype)

    def run_sequence(self, seg: Segment, backend: str, sequence_fn: SequenceFn, short_fn: Callable) -> None:
        """One long run through `sequence_fn`; where it raises, `backend` is recorded as refused
        (logged) and the run goes to `short_fn`."""
        t0, t1 = self.cu[seg.lo], self.cu[seg.hi]
        k_ctx, v_ctx = self.context(seg)
        try:
            self.o[t0:t1].copy_(sequence_fn(self.q[t0:t1], k_ctx, v_ctx, self.scale))
        except RuntimeError as error:  # e.g. "No available kernel": this GPU / torch lacks the backend
            _REFUSED.add(backend)
            log.warning("prefill attention: %s refused (%s); the Triton kernel runs instead", backend,
                        _first_line(error))
            self.run_short(seg, short_fn)


def attention_prefill_triton(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *, out=None,
                             max_seqlen: int | None = None) -> torch.Tensor:
    """The whole batch in the Triton kernel, `max_seqlen` from the cached host lengths on CUDA."""
    if max_seqlen is None and q.is_cuda and cu_seqlens.numel() > 1:
        cu, _ = host_lengths.get(cu_seqlens, kv_indptr)  # one sync per batch, not per layer
        max_seqlen = max(b - a for a, b in zip(cu, cu[1:]))
    return triton_attention.attention_prefill(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale,
                                              out=out, max_seqlen=max_seqlen)


def attention_prefill(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *, out=None,
                      max_seqlen: int | None = None):
    """Causal varlen attention; each sequence's new tokens are the last of its context.

    q [T, H, d] → o [T, H, d] in q.dtype (docs/MODULES.md). Long runs go to cuDNN where it can
    run (CUDA, bf16/fp16), everything else to the Triton kernel."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return attention_prefill_triton(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, out=out,
                                        max_seqlen=max_seqlen)
    return attention_prefill_with(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, out=out)


def attention_prefill_with(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *, out=None,
                           min_run: int = MIN_RUN, sequence_fn: SequenceFn = run_cudnn,
                           short_fn: Callable = triton_attention.attention_prefill) -> torch.Tensor:
    """`attention_prefill` without the device / dtype check: the long-run backend (`sequence_fn`)
    and the short-run kernel (`short_fn`) are parameters so that CPU tests can put the reference
    in their place."""
    o = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0 or cu_seqlens.numel() < 2:
        return o
    batch = PrefillBatch.of(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, o)
    for seg in plan_segments(batch.new_lens, min_run):
        if batch.cu[seg.lo] == batch.cu[seg.hi]:
            continue
        if seg.kind == "triton" or "sdpa-cudnn" in _REFUSED:  # a refused backend: Triton from then on
            batch.run_short(seg, short_fn)
        else:
            batch.run_sequence(seg, "sdpa-cudnn", sequence_fn, short_fn)
    return o
