"""Prefill attention backends at the 27B attention shapes (GPU): which is fastest, which accept what.

    python -m benchmarks.attention_backends --json /tmp/attn.json      # all shapes, all backends
    python -m benchmarks.attention_backends --shapes 8x2048 --backends sdpa,varlen
    python -m benchmarks.attention_backends --quick                    # CPU smoke run (tiny shapes)
    python -m benchmarks.attention_backends --e2e --policy varlen      # model prefill, old vs new path

Shapes (d 256, 24 query heads, 4 KV heads, bf16, causal; each sequence's new tokens are the last of
its context, as `attention_prefill`'s contract says):

    8x2048          8 sequences × 2,048 new tokens, nothing cached
    4x8192          4 × 8,192 new
    1x32768         1 × 32,768 new
    prefix8x2k+2k   8 sequences × (2,048 cached + 2,048 new): lower-right causal
    prefix1x8k+8k   a 32k prompt's second 8k chunk (8,192 cached + 8,192 new)
    prefix1x24k+8k  its last chunk (24,576 cached + 8,192 new)

K/V live in a token-granular paged pool [S_kv, H_kv, d] at shuffled slots (the engine's layout).
Backends:

    triton[bm,bn,w]   kernels/attention/attention.py `attention_prefill` (reads the pool through the slot table)
    sdpa-<b>-<gqa>    torch SDPA with one backend forced (cudnn, flash, efficient) on [B, H, S, d]
                      views; GQA by enable_gqa=True ("gqa") or KV heads repeated ("rep"); causal by
                      is_causal (no prefix) or causal_lower_right / a dense bool mask / the cuDNN
                      split (prefix and own keys as two calls merged by log-sum-exp) (prefix)
    varlen            torch.nn.attention.varlen.varlen_attn on the packed tokens (flash; causal is
                      bottom-right aligned, so the prefix case is native)
    flex              flex_attention (compiled on CUDA) with a block mask of packed causal documents
    fa[bm,bn,w,s]     benchmarks/attention_arms/prefill_fa.py (FA2-style, reads the pool): each launch of its
                      autotune list, and `fa[autotune]` (what the model gets)
    op[<policy>]      the model's op under each backend policy (benchmarks/attention_arms/; the model
                      itself runs op[sdpa-cudnn+split], kernels/attention/prefill.py)
                      (long runs ≥ 1,024 new tokens to the backend): gather, offsets and copies included

`--e2e`: prefill tokens/s of the qwen3.5-27b preset (64 layers, bf16, random weights, engine API,
random prompts, nothing shared, 1 output token) with the Triton path and with `--policy`'s, at
32 × 8,192 and 4 × 32,768 (chunked by max_batch_tokens 8,192, so the 32k prompts run as prefix
chunks); beside them the cuBLAS floor of one 8,192-token step: every projection GEMM of the model
(F.linear at its exact shape, T = 8,192; lm_head excluded: it runs on one row per sequence) timed
alone and summed, against the measured step time (8,192 / tokens per second).

Columns: `core ms` is the backend call alone on prepared inputs (K/V already contiguous);
`e2e ms` adds gathering K/V out of the pool (index_select) and writing the packed [T, H, d]
output; `gather ms` (per shape) is the K/V gather alone. TFLOP/s = 4 · d · H · Σ_seq Σ_query
(visible keys) / time: causal pairs counted exactly (n·c + n(n+1)/2 per sequence of n new
tokens after c cached), no softmax FLOPs. `err` is the max abs error against an fp32 reference
on 24 query rows of sequence 0 (first, middle, last), all heads; every output buffer starts as
NaN and any NaN left in the output is reported. A backend that refuses a case is listed with
the first line of its error.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from benchmarks.bench_utils import print_table


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    new: int  # new tokens per sequence
    cached: int = 0  # cached context per sequence (before its new tokens)

    @property
    def ctx(self) -> int:
        return self.cached + self.new

    def causal_pairs(self) -> int:
        """(query, visible key) pairs over the batch."""
        return self.batch * (self.new * self.cached + self.new * (self.new + 1) // 2)


SHAPES = [Shape("8x2048", 8, 2048), Shape("4x8192", 4, 8192), Shape("1x32768", 1, 32768),
          Shape("prefix8x2k+2k", 8, 2048, 2048), Shape("prefix1x8k+8k", 1, 8192, 8192),
          Shape("prefix1x24k+8k", 1, 8192, 24576)]
QUICK_SHAPES = [Shape("2x64", 2, 64), Shape("prefix2x32+32", 2, 32, 32)]
TRITON_LAUNCHES = [(64, 32, 8), (64, 64, 8), (128, 32, 8), (128, 64, 8)]  # block_m, block_n, num_warps


@dataclass(frozen=True)
class Heads:
    q: int = 24
    kv: int = 4
    dim: int = 256


def attention_flops(shape: Shape, heads: Heads) -> float:
    return 4.0 * heads.dim * heads.q * shape.causal_pairs()


@dataclass
class Case:
    """One shape's inputs: packed queries, the paged pool and its slot table (+ contiguous copies)."""
    shape: Shape
    heads: Heads
    q: torch.Tensor  # [T, H, d]
    k_cache: torch.Tensor  # [S_kv, H_kv, d]
    v_cache: torch.Tensor  # [S_kv, H_kv, d]
    kv_indices: torch.Tensor  # [Σctx] int64
    kv_indptr: torch.Tensor  # [B+1] int32
    cu_seqlens: torch.Tensor  # [B+1] int32
    k_ctx: torch.Tensor  # [Σctx, H_kv, d]: the pool gathered (what SDPA-style backends read)
    v_ctx: torch.Tensor
    ref_rows: torch.Tensor  # [R] int64 token rows of sequence 0 checked against the fp32 reference
    ref_out: torch.Tensor  # [R, H, d] fp32

    @property
    def scale(self) -> float:
        return self.heads.dim ** -0.5


def build_case(shape: Shape, heads: Heads, dtype: torch.dtype, device: str, seed: int = 0) -> Case:
    gen = torch.Generator(device=device).manual_seed(seed)
    B, n, ctx = shape.batch, shape.new, shape.ctx
    T, total_ctx = B * n, B * ctx
    pool = total_ctx + 64  # a few unused slots: their garbage must never be read
    k_cache = torch.randn(pool, heads.kv, heads.dim, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(pool, heads.kv, heads.dim, generator=gen, device=device, dtype=dtype)
    kv_indices = torch.randperm(pool, generator=gen, device=device)[:total_ctx]  # shuffled slots
    q = torch.randn(T, heads.q, heads.dim, generator=gen, device=device, dtype=dtype)
    kv_indptr = torch.arange(0, total_ctx + 1, ctx, device=device, dtype=torch.int32)
    cu_seqlens = torch.arange(0, T + 1, n, device=device, dtype=torch.int32)
    k_ctx, v_ctx = k_cache.index_select(0, kv_indices), v_cache.index_select(0, kv_indices)
    picks = sorted({*range(min(8, n)), *range(n // 2, min(n, n // 2 + 8)), *range(max(0, n - 8), n)})
    ref_rows = torch.tensor(picks, device=device, dtype=torch.int64)
    case = Case(shape, heads, q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, k_ctx, v_ctx, ref_rows,
                torch.empty(0))
    case.ref_out = reference_rows(case)
    return case


def reference_rows(case: Case) -> torch.Tensor:
    """fp32 attention of sequence 0's `ref_rows` over its whole context → [R, H, d]."""
    shape, heads = case.shape, case.heads
    group = heads.q // heads.kv
    keys = case.k_ctx[:shape.ctx].float().repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, d]
    values = case.v_ctx[:shape.ctx].float().repeat_interleave(group, 1).transpose(0, 1)
    queries = case.q[case.ref_rows].float().transpose(0, 1)  # [H, R, d]
    scores = queries @ keys.transpose(1, 2) * case.scale  # [H, R, ctx]
    q_pos = shape.cached + case.ref_rows  # context position of each checked row
    visible = torch.arange(shape.ctx, device=scores.device)[None, :] <= q_pos[:, None]  # [R, ctx]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return (torch.softmax(scores, -1) @ values).transpose(0, 1)  # [R, H, d]


# ---------------------------------------------------------------- backends
# Each `prepare_*` returns (core, e2e): core() runs the backend on prepared inputs, e2e() gathers
# from the pool, runs, and returns the packed [T, H, d] output.

Prepared = tuple[Callable[[], object], Callable[[], torch.Tensor]]


def _nan_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def _gather(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return case.k_cache.index_select(0, case.kv_indices), case.v_cache.index_select(0, case.kv_indices)


def prepare_triton(case: Case, block_m: int, block_n: int, num_warps: int) -> Prepared:
    from batchinfer.kernels.attention import attention_prefill
    out = _nan_like(case.q)

    def run():
        return attention_prefill(case.q, case.k_cache, case.v_cache, case.kv_indices, case.kv_indptr,
                                 case.cu_seqlens, case.scale, out=out, max_seqlen=case.shape.new,
                                 block_m=block_m, block_n=block_n, num_warps=num_warps)
    return run, run


_SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def prepare_sdpa(case: Case, backend: str, gqa: str, mask: str) -> Prepared:
    """gqa: "gqa" (enable_gqa=True) or "rep" (KV heads repeated); mask: "causal" (is_causal,
    no prefix only), "lower_right" (CausalBias), "dense" (bool [n, ctx]) or "split" (cuDNN only:
    prefix and own keys as two calls merged by log-sum-exp, kernels/attention/prefill.py)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from batchinfer.kernels.attention.prefill import cudnn_attend, split_prefix_attention

    shape, heads = case.shape, case.heads
    B, n, ctx, H, H_kv, d = shape.batch, shape.new, shape.ctx, heads.q, heads.kv, heads.dim
    group = H // H_kv
    which = getattr(SDPBackend, _SDPA_BACKENDS[backend])
    kwargs: dict = {"scale": case.scale}
    if mask == "causal":
        if shape.cached:
            raise ValueError("is_causal is top-left aligned: wrong with a cached prefix")
        kwargs["is_causal"] = True
    elif mask == "lower_right":
        kwargs["attn_mask"] = causal_lower_right(n, ctx)
    elif mask == "split":
        if backend != "cudnn" or not shape.cached:
            raise ValueError("the split runs cuDNN after a cached prefix")
    else:
        pos = torch.arange(ctx, device=case.q.device)
        kwargs["attn_mask"] = pos[None, :] <= (shape.cached + torch.arange(n, device=case.q.device))[:, None]
    if gqa == "gqa":
        kwargs["enable_gqa"] = True

    def layout_kv(k_ctx, v_ctx):
        k4 = k_ctx.view(B, ctx, H_kv, d).transpose(1, 2)  # [B, H_kv, ctx, d] (a view)
        v4 = v_ctx.view(B, ctx, H_kv, d).transpose(1, 2)
        if gqa == "rep":
            k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)  # [B, H, ctx, d]
        return k4, v4

    q4 = case.q.view(B, n, H, d).transpose(1, 2)  # [B, H, n, d] (a view)
    k4, v4 = layout_kv(case.k_ctx, case.v_ctx)
    out = _nan_like(case.q)

    def attend(kk, vv):  # → [B, H, n, d]
        if mask == "split":
            return split_prefix_attention(q4, kk, vv, case.scale, cudnn_attend)
        with sdpa_kernel([which]):
            return F.scaled_dot_product_attention(q4, kk, vv, **kwargs)

    def core():
        return attend(k4, v4)

    def e2e():
        o = attend(*layout_kv(*_gather(case)))  # [B, H, n, d]
        out.view(B, n, H, d).copy_(o.transpose(1, 2))
        return out
    return core, e2e


def varlen_kwargs(fn, causal: bool, gqa: bool, scale: float) -> dict:
    """Keyword arguments of this torch's varlen_attn: its signature changed between releases
    (is_causal in 2.9; window_size (-1, 0) for causal and scale from 2.10; enable_gqa later)."""
    params = inspect.signature(fn).parameters
    kwargs: dict = {}
    if causal:
        if "is_causal" in params:
            kwargs["is_causal"] = True
        elif "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:
            raise TypeError("varlen_attn takes neither is_causal nor window_size")
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, 1.0):
        pass  # default scale is 1/sqrt(d): what the benchmark uses
    if gqa:
        if "enable_gqa" not in params:
            raise TypeError("varlen_attn has no enable_gqa")
        kwargs["enable_gqa"] = True
    return kwargs


def prepare_varlen(case: Case, gqa: str) -> Prepared:
    from torch.nn.attention.varlen import varlen_attn

    shape, heads = case.shape, case.heads
    group = heads.q // heads.kv
    kwargs = varlen_kwargs(varlen_attn, True, gqa == "gqa", case.scale)
    cu_k = case.kv_indptr

    def layout(k_ctx, v_ctx):
        if gqa == "rep":
            return k_ctx.repeat_interleave(group, 1), v_ctx.repeat_interleave(group, 1)  # [Σctx, H, d]
        return k_ctx, v_ctx

    k, v = layout(case.k_ctx, case.v_ctx)

    def core():
        return varlen_attn(case.q, k, v, case.cu_seqlens, cu_k, shape.new, shape.ctx, **kwargs)

    def e2e():
        kk, vv = layout(*_gather(case))
        return varlen_attn(case.q, kk, vv, case.cu_seqlens, cu_k, shape.new, shape.ctx, **kwargs)
    return core, e2e


FLEX_OPTIONS = [None, {"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 64, "BLOCK_N": 32}]


def prepare_flex(case: Case, options: dict | None) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    shape, device = case.shape, case.q.device
    B, n, ctx = shape.batch, shape.new, shape.ctx
    q_doc = torch.arange(B, device=device).repeat_interleave(n)  # [T]
    q_pos = (shape.cached + torch.arange(n, device=device)).repeat(B)  # context position of each query
    k_doc = torch.arange(B, device=device).repeat_interleave(ctx)  # [Σctx]
    k_pos = torch.arange(ctx, device=device).repeat(B)

    def packed_causal(b, h, q_idx, kv_idx):
        return (q_doc[q_idx] == k_doc[kv_idx]) & (k_pos[kv_idx] <= q_pos[q_idx])

    compiled = device.type == "cuda"
    block_mask = create_block_mask(packed_causal, None, None, B * n, B * ctx, device=device, _compile=compiled)
    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    kwargs = {"block_mask": block_mask, "scale": case.scale, "enable_gqa": True}
    if options:
        kwargs["kernel_options"] = options
    q1 = case.q.transpose(0, 1).unsqueeze(0)  # [1, H, T, d] (a view)

    def kv1(k_ctx, v_ctx):
        return k_ctx.transpose(0, 1).unsqueeze(0), v_ctx.transpose(0, 1).unsqueeze(0)  # [1, H_kv, Σctx, d]

    k1, v1 = kv1(case.k_ctx, case.v_ctx)
    out = _nan_like(case.q)

    def core():
        return fn(q1, k1, v1, **kwargs)

    def e2e():
        o = fn(q1, *kv1(*_gather(case)), **kwargs)  # [1, H, T, d]
        out.copy_(o[0].transpose(0, 1))
        return out
    return core, e2e


# ---------------------------------------------------------------- measuring

def time_ms(fn: Callable[[], object], warmup: int, reps: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]


def measure(case: Case, name: str, prepare: Callable[[], Prepared], args, device: str) -> dict:
    row = {"shape": case.shape.name, "backend": name}
    flops = attention_flops(case.shape, case.heads)
    try:
        core, e2e = prepare()
        out = e2e()
        if device == "cuda":
            torch.cuda.synchronize()
        row["nan"] = bool(torch.isnan(out).any())
        row["err"] = float((out[case.ref_rows].float() - case.ref_out).abs().max())
        row["core_ms"] = time_ms(core, args.warmup, args.reps, device)
        row["e2e_ms"] = time_ms(e2e, args.warmup, args.reps, device)
        row["core_tflops"] = flops / row["core_ms"] / 1e9
        row["e2e_tflops"] = flops / row["e2e_ms"] / 1e9
    except Exception as exc:  # a backend refusing a case is a result, not a failure
        row["rejected"] = _first_line(exc)
    if device == "cuda":
        torch.cuda.empty_cache()
    print(_format(row), flush=True)
    return row


def backend_runs(case: Case, wanted: set[str], quick: bool, args):
    """(name, prepare) of every requested backend variant for this case."""
    if "triton" in wanted:
        for bm, bn, w in TRITON_LAUNCHES[:1] if quick else TRITON_LAUNCHES:
            yield f"triton[{bm},{bn},{w}]", lambda bm=bm, bn=bn, w=w: prepare_triton(case, bm, bn, w)
    if "sdpa" in wanted:
        masks = ["lower_right", "dense"] if case.shape.cached else ["causal"]
        for backend in _SDPA_BACKENDS:
            for gqa in ("gqa", "rep"):
                for mask in masks + (["split"] if backend == "cudnn" and case.shape.cached else []):
                    yield (f"sdpa-{backend}-{gqa}-{mask}",
                           lambda b=backend, g=gqa, m=mask: prepare_sdpa(case, b, g, m))
    if "varlen" in wanted:
        for gqa in ("gqa", "rep"):
            yield f"varlen-{gqa}", lambda g=gqa: prepare_varlen(case, g)
    if "flex" in wanted:
        yield "flex", None  # handled in run_flex: tries kernel options until one compiles
    if "fa" in wanted:
        from benchmarks.attention_arms.prefill_fa import AUTOTUNE, FaLaunch
        launches = [FaLaunch(16, 16, 4, 1)] if quick else AUTOTUNE
        for c in launches:
            yield (f"fa[{c.block_m},{c.block_n},{c.num_warps},{c.num_stages}]",
                   lambda c=c: prepare_fa(case, c))
        if not quick:
            yield "fa[autotune]", lambda: prepare_fa(case, None)
    if "op" in wanted:
        for policy in op_policies(args)[:2] if quick else op_policies(args):  # CPU: all fall back to Triton
            yield policy_label(policy), lambda p=policy: prepare_op(case, p)


def prepare_fa(case: Case, launch) -> Prepared:
    from benchmarks.attention_arms.prefill_fa import attention_prefill_fa
    out = _nan_like(case.q)

    def run():
        return attention_prefill_fa(case.q, case.k_cache, case.v_cache, case.kv_indices, case.kv_indptr,
                                    case.cu_seqlens, case.scale, out=out, max_seqlen=case.shape.new, launch=launch)
    return run, run


def prepare_op(case: Case, policy) -> Prepared:
    from benchmarks.attention_arms.backends import attention_prefill_under
    out = _nan_like(case.q)

    def run():
        return attention_prefill_under(policy, case.q, case.k_cache, case.v_cache, case.kv_indices, case.kv_indptr,
                                       case.cu_seqlens, case.scale, out=out)
    return run, run


def op_policies(args):
    from benchmarks.attention_arms.policy import BACKENDS, PrefillPolicy
    policies = [PrefillPolicy(b, min_run=args.min_run) for b in BACKENDS]
    policies.append(PrefillPolicy("sdpa-cudnn", min_run=args.min_run, repeat_kv=True))
    policies.append(PrefillPolicy("sdpa-cudnn", min_run=args.min_run, prefix_mask="dense"))
    policies.append(PrefillPolicy("sdpa-cudnn", min_run=args.min_run, prefix_mask="split"))
    return policies


def policy_label(policy) -> str:
    extra = ("+rep" if policy.repeat_kv else "") + (f"+{policy.prefix_mask}" if policy.prefix_mask != "lower_right" else "")
    return f"op[{policy.backend}{extra}]"


def run_flex(case: Case, args, device: str) -> dict:
    row = None
    for options in FLEX_OPTIONS:
        label = "flex" if options is None else f"flex[{options['BLOCK_M']},{options['BLOCK_N']}]"
        row = measure(case, label, lambda o=options: prepare_flex(case, o), args, device)
        if "rejected" not in row:
            return row
    return row


def gather_row(case: Case, args, device: str) -> dict:
    ms = time_ms(lambda: _gather(case), args.warmup, args.reps, device)
    moved = 2 * 2 * case.k_ctx.numel() * case.k_ctx.element_size()  # read + write, K and V
    row = {"shape": case.shape.name, "backend": "gather K,V (index_select)", "core_ms": ms, "e2e_ms": ms,
           "gbps": moved / ms / 1e6}
    print(_format(row), flush=True)
    return row


def _format(row: dict) -> str:
    if "rejected" in row:
        return f"{row['shape']:<14} {row['backend']:<34} rejected: {row['rejected']}"
    if "gbps" in row:
        return f"{row['shape']:<14} {row['backend']:<34} {row['core_ms']:9.3f} ms  ({row['gbps']:,.0f} GB/s)"
    nan = "  NaN LEFT" if row.get("nan") else ""
    return (f"{row['shape']:<14} {row['backend']:<34} {row['core_ms']:9.3f} {row['core_tflops']:8.1f} "
            f"{row['e2e_ms']:9.3f} {row['e2e_tflops']:8.1f} {row['err']:9.2e}{nan}")


HEADER = f"{'shape':<14} {'backend':<34} {'core ms':>9} {'TFLOP/s':>8} {'e2e ms':>9} {'TFLOP/s':>8} {'err':>9}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 reps: a CPU smoke run")
    parser.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    parser.add_argument("--backends", default="triton,fa,sdpa,varlen,flex,op")
    parser.add_argument("--min-run", type=int, default=1024, help="op / e2e policies: long-run threshold")
    parser.add_argument("--e2e", action="store_true", help="model prefill tokens/s, old vs new path (see above)")
    parser.add_argument("--policy", default="varlen", help="--e2e: the new path's backend")
    parser.add_argument("--repeat-kv", action="store_true", help="--e2e policy: KV heads repeated for SDPA")
    parser.add_argument("--prefix-mask", default="lower_right", help="--e2e policy: lower_right or dense")
    parser.add_argument("--layers", type=int, default=None, help="--e2e: model depth (default 64; 4 with --quick)")
    parser.add_argument("--workloads", default="32x8192,4x32768", help="--e2e: prompts x tokens")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (median; default 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/ is imported
    args.reps = args.reps or (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.e2e:
        from benchmarks.attention_e2e import run_e2e
        run_e2e(args, device)
        return
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [s for s in SHAPES + QUICK_SHAPES if s.name in args.shapes.split(",")]
    heads = Heads(q=6, kv=1, dim=256) if args.quick else Heads()
    wanted = set(args.backends.split(","))
    dtype = torch.bfloat16
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "heads": asdict(heads), "dtype": str(dtype), "reps": args.reps, "warmup": args.warmup}
    print(json.dumps(meta))
    rows: list[dict] = []
    for shape in shapes:
        case = build_case(shape, heads, dtype, device)
        rows.append(gather_row(case, args, device))
        for name, prepare in backend_runs(case, wanted, args.quick, args):
            if name == "flex":
                rows.append(run_flex(case, args, device))
            else:
                rows.append(measure(case, name, prepare, args, device))
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    print()
    print(f"d {heads.dim}, {heads.q}/{heads.kv} heads, {dtype}, causal; TFLOP/s = 4·d·H·(causal pairs) / time")
    print_table(HEADER, map(_format, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
