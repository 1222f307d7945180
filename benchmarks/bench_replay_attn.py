"""ReplaySSM decode vs fla's fused recurrent decode, and attention decode bandwidth (H200).

    python -m benchmarks.bench_replay_attn [--quick]
    python -m benchmarks.bench_replay_attn --shared    # only case 5 (< 1 min)
    python -m benchmarks.bench_replay_attn --fp8-kv    # only case 6 (~1 min)

1. Correctness at the benchmark shapes (small batch) against kernels/ref, for every ReplaySSM
   launch config that will be timed; aborts on mismatch.
2. ReplaySSM step (16 key / 48 value heads × 128, bf16 checkpoint, L = 16) at batch 128 and
   512. Cursors start staggered over 1..L and each timed call runs L steps with the cursors
   the runner would produce (`c <- c % L + 1`), so every sequence passes cursor == L, i.e.
   flushes, exactly once per call: time / L is the per-step time with flushes amortised.
   Each step is the whole op (flush launch + step launch). Baseline: fla-core 0.6.0
   `fused_recurrent_gated_delta_rule` on the same inputs (fp32 state read + written).
   Target: >= 3x. Both sides are timed as CUDA-graph replays (`bench_graph`): GPU time, as
   in the engine's decode graphs, without Python launch overhead. The step kernel's launch configs (`REPLAY_SWEEP`) are always swept; the
   table shows the default and the best (set the winner as DEFAULT_STEP_LAUNCH if it differs).
3. Attention decode (24 heads / 4 KV heads × 256, bf16) at batch 128 with 2k and 8k contexts
   over a shuffled token pool: KV bytes / time as % of 4.28 TB/s. Target: >= 80%.
4. Attention prefill: the Triton flash kernel vs gather + torch SDPA (is_causal), for the record.
5. "attention_decode shared": a RAG-shaped decode step (B=256 in 8 groups of 32 rows sharing a
   2048-token prefix, 136 own tokens each, bf16) plain vs with the `shared_with_prev` hint (the
   prefix streamed once per row block), as bytes-once bandwidth (KV bytes with each group's
   prefix counted once / time) and the speedup; the shared stage's launch knobs are swept, every
   config checked against the reference first.
6. `--fp8-kv`: attention decode over a bf16 pool against an FP8 (e4m3) pool at the 8k / 1k jobs'
   full batches (the 27B's 24 / 4 heads at 96 rows, the 35B-A3B's 16 / 2 at 256; 8,704
   positions a row), each checked against the fp32 reference over its pool first, the launch
   configs swept: the pool's bytes / time, and the FP8 pool's time against the bf16 pool's.

Without --quick, attention decode is also swept over a few launch configs (default and best shown).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton

from batchinfer.kernels import attention as triton_attention
from batchinfer.kernels import replay_ssm as triton_replay
from batchinfer.kernels.attention import SharedPrefixLaunch
from batchinfer.kernels.ref import attention as ref_attention
from batchinfer.kernels.ref import replay as ref_replay

PEAK_BYTES_PER_S = 4.28e12  # H200 copy bandwidth measured by the lead

# ReplaySSM launch configs: d_v block × d_k chunk × warps × pipeline stages of the step, and
# the flush's d_v block × warps. A d_k chunk equal to d_k (128) is one loop iteration, where
# stages do not matter. Small blocks with few warps = many small programs in flight per SM
# (what fla's fused recurrent kernel does); large ones = more bytes per program.
_DEFAULT = triton_replay.DEFAULT_STEP_LAUNCH
# The step sweep's base: one warp, 32 columns of d_v, d_k in 32-row chunks 4 deep, every optional
# path off (the per-(sequence, value head, d_v block) flush, all L ring entries loaded).
_PLAIN = triton_replay.StepLaunch(block_v=32, block_k=32, num_warps=1, num_stages=4, key_dots_in_flush=False,
                                  flush_block_v=32, flush_block_k=16, flush_warps=1, flush_per_key_head=False,
                                  flush_persistent=False, flush_programs_per_sm=2, flush_tile_items=False,
                                  live_ring_loads=False)
# The non-persistent flush: one program per (sequence, key head), all L ring entries loaded.
_PER_KEY_HEAD_FLUSH = replace(_DEFAULT, flush_persistent=False, live_ring_loads=False)
FLUSH_SWEEP = [_DEFAULT] + [
    # The flush launch and the ring loads around the default (persistent flush over the full
    # rings only, key dots in their own launch, live ring entries only): the non-persistent flush
    # per (sequence, key head) and per (sequence, value head, d_v block), each change alone, and
    # the persistent flush's programs per SM × d_k rows per chunk × warps.
    _PER_KEY_HEAD_FLUSH,
    replace(_PER_KEY_HEAD_FLUSH, flush_block_v=32, flush_block_k=16, flush_warps=1, flush_per_key_head=False),
    replace(_PER_KEY_HEAD_FLUSH, live_ring_loads=True),
    replace(_DEFAULT, live_ring_loads=False),
    # Work items of one (row, key head) instead of one (row, value head, d_v block) tile; programs
    # per SM; narrower tiles.
    replace(_DEFAULT, flush_tile_items=False, flush_programs_per_sm=4),
    replace(_DEFAULT, flush_tile_items=False),
    replace(_DEFAULT, flush_programs_per_sm=4),
    replace(_DEFAULT, flush_block_v=64, flush_warps=2),
    replace(_DEFAULT, flush_programs_per_sm=16, flush_block_v=64, flush_warps=2),
]  # what --replay times
REPLAY_SWEEP = FLUSH_SWEEP + [
    # Step: mma d_k dots (default) vs CUDA-core ones, ring-key dots in the step or once per key
    # head in the flush launch, d_k chunk / stages / d_v block / warps around the default.
    replace(_PLAIN, tensor_cores=False),
    replace(_PLAIN, key_dots_in_flush=True),
    replace(_PLAIN, tensor_cores=False, key_dots_in_flush=True),
    replace(_PLAIN, block_k=64, num_stages=3),
    replace(_PLAIN, block_k=64, num_stages=3, key_dots_in_flush=True),
    replace(_PLAIN, block_k=128, num_stages=1),
    replace(_PLAIN, block_k=128, num_stages=1, key_dots_in_flush=True),
    replace(_PLAIN, block_v=64, num_warps=2),
    replace(_PLAIN, block_v=64, block_k=64, num_warps=2, num_stages=3, key_dots_in_flush=True),
    replace(_PLAIN, block_v=16, key_dots_in_flush=True),
    replace(_PLAIN, num_stages=2),
] + [
    # Flush: d_v block × d_k rows per chunk × warps (registers bound how many of its mostly
    # early-exiting programs are resident per SM). (128, 128, 4) is ~the old per-(seq, head) shape.
    replace(_PLAIN, flush_block_v=fbv, flush_block_k=fbk, flush_warps=fw)
    for fbv, fbk, fw in [(32, 32, 1), (32, 16, 2), (64, 16, 1), (16, 16, 1), (128, 32, 4), (128, 32, 8), (128, 128, 4)]
]

@dataclass(frozen=True)
class GdnShape:
    heads_k: int = 16
    heads_v: int = 48
    d_k: int = 128
    d_v: int = 128
    ring: int = 16


@dataclass(frozen=True)
class AttnShape:
    heads: int = 24
    kv_heads: int = 4
    d: int = 256


@dataclass
class Row:
    name: str
    time_us: float
    detail: str


def bench(fn) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench flushes L2 between calls)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def capture_graph(fn) -> tuple[Optional[Callable[[], object]], Optional[Exception]]:
    """(`fn` captured in a CUDA graph: its replay, None) or (None, why it cannot be captured, e.g.
    a host sync inside fn); fn runs twice first on a side stream (compile and warm)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and warm outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - e.g. a host sync inside fn
        return None, exc
    return graph.replay, None


def bench_graph(fn) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: GPU time without Python launch
    overhead, which the engine never pays either (its decode steps are graphs). Both sides of a
    comparison go through here. Falls back to eager timing (printed) if capture fails."""
    replay, failure = capture_graph(fn)
    if replay is None:
        print(f"  (CUDA graph capture failed: {type(failure).__name__}; timed eagerly)")
        return bench(fn)
    return bench(replay)


# ---------------------------------------------------------------- ReplaySSM

def make_replay_state(shape: GdnShape, batch: int, dtype=torch.bfloat16, seed=0):
    """Pools for `batch` slots (shuffled), staggered cursors 1..L, and one step's inputs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, L = batch, shape.ring

    def randn(*size, dt=dtype):
        return torch.randn(*size, generator=gen, device="cuda").to(dt)

    ckpt = randn(B, shape.heads_v, shape.d_k, shape.d_v) * 0.1
    ring_k = F.normalize(randn(B, L, shape.heads_k, shape.d_k, dt=torch.float32), dim=-1).to(dtype)
    ring_u = randn(B, L, shape.heads_v, shape.d_v) * 0.1
    ring_g = -(torch.rand(B, L, shape.heads_v, generator=gen, device="cuda") * 0.1).cumsum(1)
    cursor = torch.randint(1, L + 1, (B,), generator=gen, device="cuda", dtype=torch.int32)
    slots = torch.randperm(B, generator=gen, device="cuda")
    pools = [ckpt, ring_k, ring_u, ring_g, cursor]
    step = [randn(B, shape.heads_k, shape.d_k), randn(B, shape.heads_k, shape.d_k),
            randn(B, shape.heads_v, shape.d_v), randn(B, shape.heads_v), randn(B, shape.heads_v)]
    params = [torch.rand(shape.heads_v, device="cuda") - 0.5, torch.rand(shape.heads_v, device="cuda") - 0.5]
    return pools, step, params, slots


def cursor_cycle(cursor: torch.Tensor, L: int) -> list[torch.Tensor]:
    """The cursors of L consecutive steps under the runner's advance `c <- c % L + 1`.

    Precomputed so that the timed loop launches only the kernel (the runner advances the
    cursor once per step for all layers: negligible there, ~10% of one layer's step here).
    Starting cursors must be in 1..L: then the advance is a cycle of length L and the L
    steps can be replayed forever, each sequence flushing once per cycle.
    """
    assert int(cursor.min()) >= 1
    cursors = [cursor.clone()]
    for _ in range(L - 1):
        cursors.append(cursors[-1] % L + 1)
    return cursors


def replay_steps(pools, cursors, step, params, slots, launch):
    """One cycle of L ReplaySSM steps: one flush per sequence."""
    for cursor in cursors:
        triton_replay.replay_decode(*step, *params, *pools[:4], cursor, slots, launch=launch)


def replay_bytes_per_step(shape: GdnShape, batch: int, elem: int = 2) -> float:
    """Average state bytes per step: C read, ~L/2 live ring entries read, one entry written,
    and per L steps one flush (full ring read, C written; the flush's C read is the step's)."""
    per_head_c = shape.d_k * shape.d_v * elem
    entry = shape.d_v * elem + shape.d_k * elem * shape.heads_k / shape.heads_v + 4
    per_head = per_head_c + (shape.ring / 2) * entry + entry + (per_head_c + shape.ring * entry) / shape.ring
    return batch * shape.heads_v * per_head


def fla_bytes_per_step(shape: GdnShape, batch: int) -> float:
    return batch * shape.heads_v * shape.d_k * shape.d_v * 4 * 2


def bench_fla(shape: GdnShape, batch: int, step, params) -> float | None:
    """One fla fused recurrent decode step (ms) on the same inputs, or None without fla."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    q, k, v, a, b = (t.unsqueeze(1) for t in step)  # [B, 1, H, ·]
    state = torch.randn(batch, shape.heads_v, shape.d_k, shape.d_v, device="cuda") * 0.1

    def run():
        fused_recurrent_gated_delta_rule(q, k, v, g=a, beta=b, A_log=params[0], dt_bias=params[1],
                                         initial_state=state, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True)
    return bench_graph(run)


def describe(launch) -> str:
    return (f"bv={launch.block_v} bk={launch.block_k} w={launch.num_warps} s={launch.num_stages} "
            f"tc={int(launch.tensor_cores)} kd={int(launch.key_dots_in_flush)} "
            f"fl={launch.flush_block_v}/{launch.flush_block_k}/{launch.flush_warps}"
            f"{'/kh' if launch.flush_per_key_head else ''}"
            f"{f'/persistent x{launch.flush_programs_per_sm}' if launch.flush_persistent else ''}"
            f"{' tiles' if launch.flush_tile_items else ''}"
            f"{' live-ring' if launch.live_ring_loads else ''}")


def bench_replay(shape: GdnShape, batch: int, sweep: list = REPLAY_SWEEP, lockstep: bool = False) -> list[Row]:
    """Staggered cursors (1/L of the rings full each step, as under continuous admission), or
    with `lockstep` all rings filling on the same step (a batch admitted together, as in rag)."""
    pools, step, params, slots = make_replay_state(shape, batch)
    if lockstep:
        pools[4].fill_(1)
    cursors = cursor_cycle(pools[4], shape.ring)
    assert all(int((c == shape.ring).sum()) == 1 for c in torch.stack(cursors).T), "one flush per slot"
    timings = []
    for launch in sweep:
        ms = bench_graph(lambda: replay_steps(pools, cursors, step, params, slots, launch)) / shape.ring
        timings.append((ms, launch))
    # The flush launch alone on one step's cursors (1/L of the slots full): its share of a step.
    flush_ms = bench_graph(lambda: triton_replay.flush_full_rings(*pools[:4], cursors[0], slots))
    default_ms = timings[0][0]
    best_ms, best_launch = min(timings, key=lambda t: t[0])
    est_bytes = replay_bytes_per_step(shape, batch)
    fla_ms = bench_fla(shape, batch, step, params)
    if lockstep:
        # A step on which no ring is full (15 of every 16 in lock-step): what each launch costs
        # when there is nothing to fold.
        idle = pools[4].clone().fill_(1)
        rows = [Row(f"lockstep B={batch} {describe(launch)}", ms * 1e3, "") for ms, launch in timings]
        return rows + [
            Row(f"  no ring full B={batch} {describe(launch)}",
                bench_graph(lambda: triton_replay.replay_decode(*step, *params, *pools[:4], idle, slots,
                                                                launch=launch)) * 1e3, "")
            for launch in sweep]
    rows = [Row(f"replay step B={batch} (default {describe(sweep[0])})", default_ms * 1e3,
                f"~{est_bytes / (default_ms * 1e-3) / PEAK_BYTES_PER_S:.0%} of peak on est. bytes"),
            Row(f"replay step B={batch} (best {describe(best_launch)})", best_ms * 1e3,
                f"~{est_bytes / (best_ms * 1e-3) / PEAK_BYTES_PER_S:.0%} of peak on est. bytes")]
    rows += [Row(f"  sweep B={batch} {describe(launch)}", ms * 1e3, "") for ms, launch in timings[1:]]
    rows.append(Row(f"  of which flush launch B={batch} (default)", flush_ms * 1e3,
                    "folds the 1/L full rings; the other programs exit after reading the cursor"))
    if fla_ms is None:
        rows.append(Row(f"fla fused_recurrent B={batch}", float("nan"), "fla missing"))
    else:
        fla_bw = fla_bytes_per_step(shape, batch) / (fla_ms * 1e-3) / PEAK_BYTES_PER_S
        rows.append(Row(f"fla fused_recurrent B={batch}", fla_ms * 1e3,
                        f"{fla_bw:.0%} of peak; speedup {fla_ms / best_ms:.2f}x best, "
                        f"{fla_ms / default_ms:.2f}x default (target >= 3x)"))
    return rows


# ---------------------------------------------------------------- attention

def make_decode_batch(shape: AttnShape, batch: int, ctx: int, seed=0, kv_dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = batch * ctx
    k_cache = ref_attention.to_pool_dtype(torch.randn(total, shape.kv_heads, shape.d, generator=gen, device="cuda"),
                                          kv_dtype)
    v_cache = ref_attention.to_pool_dtype(torch.randn(total, shape.kv_heads, shape.d, generator=gen, device="cuda"),
                                          kv_dtype)
    kv_indices = torch.randperm(total, generator=gen, device="cuda")  # shuffled: worst-case gather
    kv_indptr = torch.arange(0, total + 1, ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, shape.heads, shape.d, generator=gen, device="cuda").to(torch.bfloat16)
    return q, k_cache, v_cache, kv_indices, kv_indptr


def bench_attention_decode(shape: AttnShape, batch: int, ctx: int, sweep: bool) -> list[Row]:
    q, k_cache, v_cache, kv_indices, kv_indptr = make_decode_batch(shape, batch, ctx)
    scale = shape.d ** -0.5
    kv_bytes = 2 * batch * ctx * shape.kv_heads * shape.d * 2
    configs = [{}]
    if sweep:
        configs += [{"block_n": bn, "num_warps": nw, "num_stages": ns}
                    for bn in (32, 64) for nw in (4, 8) for ns in (2, 3)]
        configs += [{"num_splits": sp} for sp in (1, 2, 4, 8, 16)]
    timings = []
    for knobs in configs:
        ms = bench(lambda: triton_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr,
                                                             scale, **knobs))
        timings.append((ms, knobs))
    rows = [Row(f"attn decode B={batch} ctx={ctx} (default)", timings[0][0] * 1e3,
                f"{kv_bytes / (timings[0][0] * 1e-3) / PEAK_BYTES_PER_S:.0%} of 4.28 TB/s (target >= 80%)")]
    if sweep:
        best_ms, best_knobs = min(timings, key=lambda t: t[0])
        rows.append(Row(f"attn decode B={batch} ctx={ctx} (best {best_knobs})", best_ms * 1e3,
                        f"{kv_bytes / (best_ms * 1e-3) / PEAK_BYTES_PER_S:.0%} of 4.28 TB/s"))
    return rows


def bench_fp8_kv_decode(shape: AttnShape, batch: int, ctx: int, sweep: bool) -> list[Row]:
    """Decode over a bf16 pool and an FP8 one at the same positions: each checked, then timed."""
    rows, best = [], {}
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        q, k_cache, v_cache, kv_indices, kv_indptr = make_decode_batch(shape, batch, ctx, kv_dtype=kv_dtype)
        scale = shape.d ** -0.5
        check = slice(0, 8)  # the reference gathers in fp32: a few rows suffice to catch a wrong kernel
        ends = kv_indptr[: check.stop + 1]
        expected = ref_attention.attention_decode(q[check], k_cache, v_cache, kv_indices[: int(ends[-1])], ends,
                                                  scale).float()
        got = triton_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale)[check].float()
        if not torch.allclose(got, expected, atol=2e-2, rtol=2e-2):
            sys.exit(f"attention decode over a {kv_dtype} pool disagrees with the reference: "
                     f"max error {(got - expected).abs().max().item():.3g}")
        kv_bytes = 2 * batch * ctx * shape.kv_heads * shape.d * k_cache.element_size()
        configs = [{}] + ([{"block_n": bn, "num_warps": nw, "num_stages": ns}
                           for bn in (32, 64, 128) for nw in (4, 8) for ns in (2, 3, 4)] if sweep else [])
        timings = [(bench(lambda: triton_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr,
                                                                    scale, **knobs)), knobs) for knobs in configs]
        name = "bf16" if kv_dtype == torch.bfloat16 else "fp8"
        label = f"attn decode {shape.heads}/{shape.kv_heads}x{shape.d} B={batch} ctx={ctx} {name} pool"
        for ms, knobs in [timings[0]] + ([min(timings, key=lambda t: t[0])] if sweep else []):
            tag = "default" if not knobs else f"best {knobs}"
            rows.append(Row(f"{label} ({tag})", ms * 1e3, f"{kv_bytes / (ms * 1e-3) / 1e12:.2f} TB/s of its pool"))
        best[name] = min(t[0] for t in timings)
    rows.append(Row(f"  fp8 pool / bf16 pool time, B={batch} (best of each)", best["fp8"] / best["bf16"] * 1e3,
                    "time ratio x1000 (500 = the bytes' ratio)"))
    return rows


def bench_attention_prefill(shape: AttnShape, n_seqs: int, seq_len: int) -> list[Row]:
    """No cached prefix, so gather + SDPA can use is_causal (its fastest path)."""
    _, k_cache, v_cache, kv_indices, _ = make_decode_batch(shape, n_seqs, seq_len)
    q = torch.randn(n_seqs * seq_len, shape.heads, shape.d, device="cuda").to(torch.bfloat16)
    bounds = torch.arange(0, n_seqs * seq_len + 1, seq_len, device="cuda", dtype=torch.int32)
    scale = shape.d ** -0.5
    group = shape.heads // shape.kv_heads
    flops = 4 * n_seqs * shape.heads * shape.d * seq_len * seq_len / 2

    def triton_run():
        triton_attention.attention_prefill(q, k_cache, v_cache, kv_indices, bounds, bounds, scale,
                                           max_seqlen=seq_len)

    def sdpa_run():
        for i in range(n_seqs):
            idx = kv_indices[i * seq_len:(i + 1) * seq_len]
            keys = k_cache[idx].transpose(0, 1).repeat_interleave(group, 0)
            values = v_cache[idx].transpose(0, 1).repeat_interleave(group, 0)
            queries = q[i * seq_len:(i + 1) * seq_len].transpose(0, 1)
            F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)

    rows = []
    for name, fn in (("triton flash", triton_run), ("gather+SDPA", sdpa_run)):
        ms = bench(fn)
        tflops = flops / (ms * 1e-3) / 1e12
        rows.append(Row(f"attn prefill {n_seqs}x{seq_len} {name}", ms * 1e3, f"{tflops:.0f} TFLOP/s"))
    return rows


# ---------------------------------------------------------------- attention, shared prefixes

@dataclass(frozen=True)
class SharedDecodeShape:
    """A RAG-shaped decode step: `groups` × `group_rows` rows, each group sharing `prefix` slots."""
    groups: int = 8
    group_rows: int = 32
    prefix: int = 2048
    own: int = 136


# The shared stage's knobs: rows per block (× GQA group padded to 8 = tile rows), KV tile, warps, stages.
SHARED_SWEEP = [SharedPrefixLaunch()] + [
    SharedPrefixLaunch(rows=r, block_n=bn, num_warps=w, num_stages=st)
    for r, bn, w, st in [(8, 32, 8, 2), (8, 32, 4, 2), (8, 32, 4, 4), (8, 16, 4, 3), (8, 64, 4, 3),
                         (8, 64, 8, 3), (4, 32, 4, 3), (16, 32, 8, 2)]
] + [
    # Splits of the shared prefix (None: num_shared_splits, 5 at the rag shape): more, shorter
    # streams per (block, KV head) fill more SMs; each adds one partial to the merge.
    SharedPrefixLaunch(num_splits=splits) for splits in (3, 8, 12, 16, 24)
]


def make_shared_decode_batch(shape: AttnShape, step: SharedDecodeShape, seed=0):
    """Pools over a shuffled token pool; rows of a group hold the group's prefix slots, then own
    ones. Returns (q, k_cache, v_cache, kv_indices, kv_indptr, shared_with_prev)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch = step.groups * step.group_rows
    total = step.groups * step.prefix + batch * step.own
    k_cache = torch.randn(total, shape.kv_heads, shape.d, generator=gen, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(total, shape.kv_heads, shape.d, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(total, generator=gen, device="cuda").to(torch.int32)
    prefixes = slots[:step.groups * step.prefix].view(step.groups, 1, step.prefix)
    owns = slots[step.groups * step.prefix:].view(step.groups, step.group_rows, step.own)
    kv_indices = torch.cat([prefixes.expand(-1, step.group_rows, -1), owns], 2).reshape(-1)
    ctx = step.prefix + step.own
    kv_indptr = torch.arange(0, batch * ctx + 1, ctx, device="cuda", dtype=torch.int32)
    shared = torch.full((step.groups, step.group_rows), step.prefix, dtype=torch.int32, device="cuda")
    shared[:, 0] = 0
    q = torch.randn(batch, shape.heads, shape.d, generator=gen, device="cuda").to(torch.bfloat16)
    return q, k_cache, v_cache, kv_indices, kv_indptr, shared.reshape(-1)


def bench_attention_decode_shared(shape: AttnShape, step: SharedDecodeShape, sweep: bool) -> list[Row]:
    q, k_cache, v_cache, kv_indices, kv_indptr, shared = make_shared_decode_batch(shape, step)
    scale = shape.d ** -0.5
    batch = step.groups * step.group_rows
    row_bytes = 2 * shape.kv_heads * shape.d * 2  # K and V of one token, bf16
    bytes_once = (step.groups * step.prefix + batch * step.own) * row_bytes
    bytes_per_row = batch * (step.prefix + step.own) * row_bytes
    expected = ref_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale).float()

    def checked(**knobs):
        out = triton_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale, **knobs)
        err = ((out.float() - expected).norm() / expected.norm()).item()
        if not err < 1e-2:
            sys.exit(f"attention_decode shared mismatch ({knobs}): relative error {err:.3g}")

    checked()
    plain_ms = bench(lambda: triton_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale))
    timings = []
    for launch in SHARED_SWEEP if sweep else SHARED_SWEEP[:1]:
        try:
            checked(shared_with_prev=shared, shared_launch=launch)
        except triton.runtime.errors.OutOfResources as exc:
            if launch == SHARED_SWEEP[0]:
                raise  # the default must run
            print(f"  shared {launch}: skipped ({exc})")
            continue
        ms = bench(lambda: triton_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, scale,
                                                             shared_with_prev=shared, shared_launch=launch))
        timings.append((ms, launch))

    def bandwidth(ms: float) -> str:
        rate = bytes_once / (ms * 1e-3)
        return f"{rate / 1e12:.2f} TB/s bytes-once ({rate / PEAK_BYTES_PER_S:.0%} of 4.28 TB/s)"

    name = f"attn decode shared B={batch} ({step.groups}x{step.group_rows}, prefix {step.prefix}, own {step.own})"
    default_ms = timings[0][0]
    rows = [Row(f"{name} plain", plain_ms * 1e3,
                f"{bandwidth(plain_ms)}; per-row bytes {bytes_per_row / (plain_ms * 1e-3) / 1e12:.2f} TB/s"),
            Row(f"{name} hint (default)", default_ms * 1e3,
                f"{bandwidth(default_ms)}; speedup {plain_ms / default_ms:.2f}x")]
    if sweep:
        best_ms, best = min(timings, key=lambda t: t[0])
        rows.append(Row(f"{name} hint (best {best})", best_ms * 1e3,
                        f"{bandwidth(best_ms)}; speedup {plain_ms / best_ms:.2f}x"))
        rows += [Row(f"  sweep {launch}", ms * 1e3, bandwidth(ms)) for ms, launch in timings[1:]]
    return rows


# ---------------------------------------------------------------- correctness, main

def check_correctness(launches: list = REPLAY_SWEEP) -> None:
    """Triton vs reference at the benchmark shapes, bf16, small batch; exits on mismatch."""
    shape = GdnShape()
    for launch in launches:
        pools, step, params, slots = make_replay_state(shape, batch=8, seed=1)
        ref_pools = [p.clone() for p in pools]
        for _ in range(shape.ring + 2):  # every slot folds at least once
            out = triton_replay.replay_decode(*step, *params, *pools, slots, launch=launch)
            expected = ref_replay.replay_decode(*step, *params, *ref_pools, slots)
            for cursor in (pools[4], ref_pools[4]):
                cursor[slots] = cursor[slots] % shape.ring + 1
            err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
            if not err < 1e-2:
                sys.exit(f"replay_decode mismatch ({describe(launch)}): relative error {err:.3g}")
        for name, tri, ref in zip(("ckpt", "ring_k", "ring_u", "ring_g"), pools, ref_pools):
            err = ((tri.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 1e-2:
                sys.exit(f"replay_decode {name} mismatch ({describe(launch)}): relative error {err:.3g}")
    attn = AttnShape()
    q, k_cache, v_cache, kv_indices, kv_indptr = make_decode_batch(attn, batch=4, ctx=1000, seed=1)
    out = triton_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, attn.d ** -0.5)
    expected = ref_attention.attention_decode(q, k_cache, v_cache, kv_indices, kv_indptr, attn.d ** -0.5)
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    if not err < 1e-2:
        sys.exit(f"attention_decode mismatch: relative error {err:.3g}")
    print("correctness vs kernels/ref: ok")


def print_rows(rows: list[Row]) -> None:
    width = max(len(r.name) for r in rows)
    print(f"{'case':<{width}}  {'time/step µs':>12}  notes")
    for r in rows:
        print(f"{r.name:<{width}}  {r.time_us:>12.1f}  {r.detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="no attention sweep, fewer prefill sequences")
    parser.add_argument("--shared", action="store_true",
                        help="only the shared-prefix decode case (5), with its launch sweep unless --quick")
    parser.add_argument("--replay", action="store_true",
                        help="only the ReplaySSM step at batch 128, 256 and 512, staggered and lock-step "
                             "cursors: the default and the flush-launch variants (all checked first)")
    parser.add_argument("--fp8-kv", action="store_true",
                        help="only attention decode over a bf16 pool against an FP8 one at the 8k / 1k full batches")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    sweep = not args.quick
    if args.fp8_kv:
        print_rows(bench_fp8_kv_decode(AttnShape(), 96, 8704, sweep)
                   + bench_fp8_kv_decode(AttnShape(heads=16, kv_heads=2), 256, 8704, sweep))
        return
    if args.replay:
        check_correctness(FLUSH_SWEEP)
        print_rows([row for batch in (128, 256, 512) for lockstep in (False, True)
                    for row in bench_replay(GdnShape(), batch, FLUSH_SWEEP, lockstep)])
        return
    if args.shared:
        print_rows(bench_attention_decode_shared(AttnShape(), SharedDecodeShape(), sweep))
        return
    check_correctness()
    rows: list[Row] = []
    for batch in (128, 512):
        rows += bench_replay(GdnShape(), batch)
    for ctx in (2048, 8192):
        rows += bench_attention_decode(AttnShape(), 128, ctx, sweep)
    rows += bench_attention_decode_shared(AttnShape(), SharedDecodeShape(), sweep)
    rows += bench_attention_prefill(AttnShape(), n_seqs=4 if args.quick else 8, seq_len=2048)
    print_rows(rows)


if __name__ == "__main__":
    main()
