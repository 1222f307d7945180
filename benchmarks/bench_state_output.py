"""Fused state pass + output (kernels/gdn_state_output.py) vs the split run_state_pass + run_output,
on the H200 at Qwen3.5-27B's GDN shapes (16 key / 48 value heads × 128, bf16).

    python -m benchmarks.bench_state_output            # 1×32768, 8×2048, 64×512
    python -m benchmarks.bench_state_output --quick

Per shape: the split pair at its default launches, then each fused launch — checked against the
split pair's output and final state (same bf16 inputs, same W/U) before it is timed. Each config
name is printed before it runs, so a crash (sticky CUDA error) names its config.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from kernels import gdn_prefill as prefill
from kernels._common import KernelLaunch as L
from kernels.gdn_state_output import run_state_output

H_K, H_V, D = 16, 48, 128
SHAPES = [(1, 32768), (8, 2048), (64, 512)]
# Spill-free on sm_90 (offline ptxas), then two with a few words parked outside the loop.
FUSED_LAUNCHES = [L(32, 4, 1), L(32, 8, 2), L(32, 8, 1), L(16, 4, 2), L(16, 8, 2), L(16, 4, 1),
                  L(32, 4, 2), L(32, 4, 3)]


def _rel_err(got, expect) -> float:
    return ((got.float() - expect.float()).norm() / expect.float().norm()).item()


def _work(num_seqs: int, seq_len: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = num_seqs * seq_len
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    x = dict(q=rnd(T, H_K, D), k=rnd(T, H_K, D), v=rnd(T, H_V, D), a=rnd(T, H_V), b=rnd(T, H_V),
             A_log=torch.empty(H_V, device="cuda").uniform_(0.0, 2.5, generator=gen).log(),
             dt_bias=torch.randn(H_V, generator=gen, device="cuda"))
    cu = torch.arange(0, T + 1, seq_len, device="cuda", dtype=torch.int32)
    slots = torch.randperm(num_seqs, device="cuda", generator=gen)
    state0 = torch.randn(num_seqs, H_V, D, D, device="cuda", generator=gen) * 0.1
    work = prefill.plan_prefill(**x, state=state0.clone(), slots=slots, cu_seqlens=cu)
    prefill.run_l2norm(work)
    prefill.run_wy(work, prefill.DEFAULT_LAUNCH.wy)
    return work, state0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40 if args.quick else 100,  # noqa: E731
                                              return_mode="median")
    for num_seqs, seq_len in SHAPES[:1] if args.quick else SHAPES:
        work, state0 = _work(num_seqs, seq_len)
        launch = prefill.DEFAULT_LAUNCH

        def split():
            prefill.run_state_pass(work, launch.state_pass)
            prefill.run_output(work, launch.output)

        work.state.copy_(state0)
        split()
        expect_out, expect_state = work.out.clone(), work.state.clone()
        split_ms = bench(split)
        print(f"{num_seqs}x{seq_len}: split state_pass {launch.state_pass} + output {launch.output}: "
              f"{split_ms * 1e3:8.1f} us", flush=True)
        for cfg in FUSED_LAUNCHES:
            print(f"  fused {cfg} ...", end=" ", flush=True)
            work.state.copy_(state0)
            work.out.fill_(float("nan"))
            run_state_output(work, cfg)
            torch.cuda.synchronize()
            err, state_err = _rel_err(work.out, expect_out), _rel_err(work.state, expect_state)
            ms = bench(lambda: run_state_output(work, cfg))
            print(f"{ms * 1e3:8.1f} us ({split_ms / ms:4.2f}x)  vs split: out {err:.1e} state {state_err:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
