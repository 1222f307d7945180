"""Why the engine's decode attention reads its KV at another rate than the kernel benchmark (H200).

`bench_replay_attn` times `attention_decode` at ~4.28 TB/s on synthetic pools, while inside the
engine's decode graph the same kernel measured ~3.8 TB/s of the nominal KV (27B shapes, 96 rows)
and, on the 35B-A3B's shapes, above the HBM's rate (so fewer positions than nominal).
`decode_profile --attention-probe` calls `probe` on the engine's own inputs of its last decode
step (the bucket graph's static batch, the first attention layer's pool; their real lengths
printed) and times the kernel as the engine calls it beside variants that each change one thing:
no shared-prefix hint, compact indices, split counts, launch configs, the same rows copied to a
fresh pool (in context order, shuffled, one uniform length), each row's slots reversed. Times
are `bench_utils.time_ms` (do_bench means, L2 flushed) of the whole call, split and merge
kernels included.
"""
from __future__ import annotations

import torch

from batchinfer.kernels import attention as triton_attention
from benchmarks.bench_utils import time_ms


def probe(batch, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> list[tuple[str, float, float, float]]:
    """(variant, ms, TB/s of the KV it reads, max |output - the engine call's|) for the engine's
    decode inputs `batch` (a ForwardBatch: kv_indices, kv_indptr, shared_with_prev) over one
    layer's pool. Every variant attends the same keys, so the last figure checks the probe."""
    B = batch.kv_indptr.numel() - 1
    H_kv, d = k_cache.shape[1], k_cache.shape[2]
    used = int(batch.kv_indptr[-1])
    kv_bytes = 2 * used * H_kv * d * k_cache.element_size()
    gen = torch.Generator(device=k_cache.device).manual_seed(0)
    q = torch.randn(B, heads, d, generator=gen, device=k_cache.device).to(torch.bfloat16)
    scale = d ** -0.5
    indices, indptr, shared = batch.kv_indices, batch.kv_indptr, batch.shared_with_prev
    compact = indices[:used]
    ctx = used // B
    rows: list[tuple[str, float, float, float]] = []
    engine_out: list[torch.Tensor] = []  # the first variant's output, [B, H, d] fp32

    def add(name, fn, same_keys=True):
        out = fn().float()  # [B, H, d]
        engine_out[:] = engine_out or [out]
        diff = (out - engine_out[0]).abs().max().item() if same_keys else float("nan")
        ms = time_ms(fn, k_cache.device.type, warmup=10, rep=60)
        rows.append((name, ms, kv_bytes / (ms * 1e-3) / 1e12, diff))

    def run(k=k_cache, v=v_cache, idx=indices, ptr=indptr, **kw):
        return lambda: triton_attention.attention_decode(q, k, v, idx, ptr, scale, **kw)

    add("engine call (graph view, shared hint)", run(shared_with_prev=shared))
    add("no shared hint", run())
    add("compact indices", run(idx=compact))
    for splits in (1, 2, 4, 8):
        add(f"num_splits={splits}", run(num_splits=splits))
    for bn, nw, ns in ((32, 4, 3), (128, 4, 2), (64, 8, 3), (64, 4, 2)):
        add(f"block_n={bn} warps={nw} stages={ns}", run(block_n=bn, num_warps=nw, num_stages=ns))
    # The same rows, copied to a fresh pool in context order: placement in the big pool or not.
    fresh_k, fresh_v = k_cache[compact].contiguous(), v_cache[compact].contiguous()  # [used, H_kv, d]
    order = torch.arange(used, device=k_cache.device)
    add("fresh pool, contiguous slots", run(k=fresh_k, v=fresh_v, idx=order))
    shuffle = torch.randperm(used, generator=gen, device=k_cache.device)
    shuffled_k, shuffled_v = torch.empty_like(fresh_k), torch.empty_like(fresh_v)
    shuffled_k[shuffle], shuffled_v[shuffle] = fresh_k, fresh_v  # position i at slot shuffle[i]
    add("fresh pool, shuffled slots", run(k=shuffled_k, v=shuffled_v, idx=shuffle))
    del shuffled_k, shuffled_v
    # The engine's pool, each row's slots in reverse: gather order within a row.
    lengths = (indptr[1:] - indptr[:-1]).long()
    starts = indptr[:-1].long().repeat_interleave(lengths)
    within = torch.arange(used, device=k_cache.device) - starts
    reversed_idx = compact[starts + lengths.repeat_interleave(lengths) - 1 - within]
    add("engine pool, slots reversed per row", run(idx=reversed_idx))
    ptr_uniform = torch.arange(0, B * ctx + 1, ctx, device=k_cache.device, dtype=torch.int32)
    add(f"fresh pool, uniform ctx {ctx}", run(k=fresh_k, v=fresh_v, idx=order[:B * ctx], ptr=ptr_uniform),
        same_keys=False)  # other contexts: timed only
    del fresh_k, fresh_v
    stats = (f"rows {B}, KV positions {used} (min {int(lengths.min())}, max {int(lengths.max())}), "
             f"indices {indices.dtype} x{indices.numel()}, pool rows {k_cache.shape[0]}, "
             f"strides k {tuple(k_cache.stride())}, shared hint nonzero {int((shared != 0).sum())}")
    rows.append((stats, float("nan"), float("nan"), float("nan")))
    return rows


def print_probe(rows: list[tuple[str, float, float, float]]) -> None:
    print("\ndecode attention on the engine's inputs (one layer, whole call):")
    for name, ms, tbs, diff in rows:
        if ms != ms:
            print(f"  {name}")
        else:
            check = "" if diff != diff else f"  max diff {diff:.1e}"
            print(f"  {name:<44} {ms * 1e3:9.1f} µs  {tbs:5.2f} TB/s of the KV{check}")
