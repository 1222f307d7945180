"""Run one kernel family a few times at its benchmark shape, for a profiler to attach to (H200).

    python -m benchmarks.profile_targets replay|decode|prefill|fla_prefill [--reps N]
    ncu --clock-control none -k regex:replay_step_kernel --launch-skip 4 --launch-count 1 \
        python -m benchmarks.profile_targets replay

Also `python -m benchmarks.profile_targets breakdown`: torch.profiler's per-kernel CUDA time of
fla-core's chunk_gated_delta_rule and of our prefill at 1×32768 and 8×2048 (where each spends).
Shapes: Qwen3.5-27B GDN (16 key / 48 value heads × 128), bf16.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from benchmarks.bench_gdn import H_K, H_V, D_K, D_V, _fla_runner, _gdn_inputs, _load_fla


def _prefill_inputs(num_seqs: int, seq_len: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = num_seqs * seq_len
    x = _gdn_inputs(T, gen)
    cu = torch.arange(0, T + 1, seq_len, device="cuda", dtype=torch.int32)
    slots = torch.arange(num_seqs, device="cuda")
    state0 = torch.randn(num_seqs, H_V, D_K, D_V, device="cuda", generator=gen) * 0.1
    return x, cu, slots, state0


def run_prefill(reps: int, num_seqs=8, seq_len=2048):
    from batchinfer.kernels import gdn_prefill
    x, cu, slots, state0 = _prefill_inputs(num_seqs, seq_len)
    for _ in range(reps):
        gdn_prefill.gdn_prefill(**x, state=state0.clone(), slots=slots, cu_seqlens=cu)
    torch.cuda.synchronize()


def run_fla_prefill(reps: int, num_seqs=8, seq_len=2048):
    fla = _load_fla()
    x, cu, slots, state0 = _prefill_inputs(num_seqs, seq_len)
    run = _fla_runner(fla[0], x, state0.clone(), (1, num_seqs * seq_len), cu.long())
    for _ in range(reps):
        run()
    torch.cuda.synchronize()


def run_decode(reps: int, batch=128):
    from batchinfer.kernels import gdn_decode
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = _gdn_inputs(batch, gen)
    state = torch.randn(batch, H_V, D_K, D_V, device="cuda", generator=gen) * 0.1
    slots = torch.randperm(batch, device="cuda", generator=gen)
    for _ in range(reps):
        gdn_decode.gdn_decode(**x, state=state, slots=slots)
    torch.cuda.synchronize()


def run_replay(reps: int, batch=128):
    from benchmarks.bench_replay_attn import GdnShape, cursor_cycle, make_replay_state, replay_steps
    from batchinfer.kernels import replay_ssm
    shape = GdnShape()
    pools, step, params, slots = make_replay_state(shape, batch)
    cursors = cursor_cycle(pools[4], shape.ring)
    for _ in range(reps):
        replay_steps(pools, cursors, step, params, slots, replay_ssm.DEFAULT_STEP_LAUNCH)
    torch.cuda.synchronize()


def breakdown() -> None:
    """Per-kernel CUDA time (µs per call, median-free: total over 10 calls / 10) for fla and ours."""
    from torch.profiler import ProfilerActivity, profile
    for num_seqs, seq_len in [(1, 32768), (8, 2048)]:
        for name, fn in [("fla", run_fla_prefill), ("ours", run_prefill)]:
            fn(3, num_seqs, seq_len)  # compile, autotune, warm
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn(10, num_seqs, seq_len)
            per_kernel = defaultdict(float)
            for evt in prof.key_averages():
                if evt.device_time_total > 0:
                    per_kernel[evt.key[:60]] += evt.device_time_total / 10
            total = sum(per_kernel.values())
            print(f"== {name} {num_seqs}x{seq_len}: {total / 1e3:.3f} ms per call (kernel time)")
            for key, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
                print(f"   {us:9.1f} us  {key}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", choices=["replay", "decode", "prefill", "fla_prefill", "breakdown"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.target == "breakdown":
        breakdown()
    else:
        {"replay": run_replay, "decode": run_decode, "prefill": run_prefill,
         "fla_prefill": run_fla_prefill}[args.target](args.reps)


if __name__ == "__main__":
    main()
