"""Fused SwiGLU activation, residual add + RMSNorm, and the conv1d decode update (one GPU, bf16).

    python -m benchmarks.bench_fused [--tokens 256] [--intermediate 17408] [--hidden 5120] [--layers 64]

Defaults: the qwen3.5-27b decode step at batch 256 (64 layers, hidden 5120, dense MLP
intermediate 17408). First every timed variant is checked against kernels/ref at these shapes
(aborts on a mismatch). Then, per op, the median time of
  - the unfused path the model ran before: `F.silu(gate) * up` (two torch kernels and a
    [T, I] intermediate); `x + delta` (torch) then the Triton `rms_norm`; also the all-torch
    reference of add + norm, for the record;
  - our fused kernel at its default launch and at every swept launch (best shown),
each replayed from a CUDA graph (as the engine's decode steps are) under
`triton.testing.do_bench` (median, L2 flushed between calls). Bandwidth is the fused op's
minimal traffic over the time: silu_mul reads gate|up and writes the product (3·T·I elements);
add_rms_norm reads x and delta and writes the sum and the normed row (4·T·N), against the
4.28 TB/s copy bandwidth. Then the conv1d decode update (`--conv-channels`, K = 4, state in a
slot pool read and written once: its minimal traffic is x, out and the state twice) at its
default and swept launches, on the pools' entry-major state and on a channel-major copy, beside fla-core's `causal_conv1d_update` on the same rows (its
cache is per batch row, [B, D, K], no slot table) when fla is installed; with
`--conv-before MODULE` also a module holding an earlier `causal_conv1d_decode` (an A/B of a
kernel change). Last line: the time saved per decode step over `--layers` layers (one
activation and two add + norm fusions per layer). Runs in well under a minute.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.bench_replay_attn import bench_graph
from batchinfer.kernels import activation as tri_act
from batchinfer.kernels import conv1d as tri_conv
from batchinfer.kernels.rmsnorm import rmsnorm as tri_norm
from batchinfer.kernels.ref import activation as ref_act
from batchinfer.kernels.ref import conv1d as ref_conv
from batchinfer.kernels.ref import norm as ref_norm

PEAK_BYTES_PER_S = 4.28e12  # H200 copy bandwidth measured by the lead
EPS = 1e-6
DTYPE = torch.bfloat16
SILU_MUL_SWEEP = [tri_act.SiluMulLaunch(block, warps) for block in (256, 512, 1024, 2048, 4096) for warps in (2, 4, 8)]
ADD_NORM_WARPS_SWEEP = [4, 8, 16, 32]
CONV_DECODE_SWEEP = [tri_conv.ConvLaunch(1, block, warps) for block in (64, 128, 256, 512, 1024) for warps in (1, 2, 4, 8)
                     if block >= 32 * warps]


@dataclass(frozen=True)
class Timed:
    name: str
    ms: float
    bytes_moved: int

    def line(self) -> str:
        rate = self.bytes_moved / (self.ms * 1e-3)
        return f"  {self.name:<44} {self.ms * 1e3:8.2f} us  {rate / 1e9:7.0f} GB/s  {100 * rate / PEAK_BYTES_PER_S:5.1f}%"


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device="cuda")).to(DTYPE)


def _check(name: str, got: torch.Tensor, expect: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(got.float(), expect.float(), rtol=1.6e-2, atol=1e-5)
    except AssertionError as err:
        sys.exit(f"{name}: wrong result, not timing it\n{err}")


def _launch_name(launch: tri_act.SiluMulLaunch) -> str:
    return f"block {launch.block}, {launch.num_warps} warps"


def bench_silu_mul(tokens: int, intermediate: int) -> tuple[Timed, Timed]:
    """(torch unfused, best fused) after printing every row."""
    gate_up = _randn(tokens, 2 * intermediate)  # [T, 2I], as F.linear returns it
    gate, up = gate_up.chunk(2, dim=-1)
    expect = ref_act.silu_mul(gate_up)
    for launch in SILU_MUL_SWEEP:
        _check(f"silu_mul {launch}", tri_act.silu_mul(gate_up, launch), expect)
    minimal = 3 * tokens * intermediate * gate_up.element_size()
    print(f"silu_mul  T={tokens} I={intermediate} bf16 (minimal traffic {minimal / 1e6:.1f} MB)")
    torch_row = Timed("torch F.silu(gate) * up", bench_graph(lambda: F.silu(gate) * up), minimal)
    default = Timed(f"fused, default ({_launch_name(tri_act.DEFAULT_SILU_MUL_LAUNCH)})",
                    bench_graph(lambda: tri_act.silu_mul(gate_up)), minimal)
    swept = [Timed(f"fused ({_launch_name(launch)})", bench_graph(lambda launch=launch: tri_act.silu_mul(gate_up, launch)), minimal)
             for launch in SILU_MUL_SWEEP]
    best = min(swept, key=lambda t: t.ms)
    for row in (torch_row, default, Timed("best: " + best.name, best.ms, minimal)):
        print(row.line())
    return torch_row, min(default, best, key=lambda t: t.ms)


def bench_add_rms_norm(tokens: int, hidden: int) -> tuple[Timed, Timed]:
    """(today's add + Triton norm, best fused) after printing every row."""
    x, delta = _randn(tokens, hidden), _randn(tokens, hidden)  # [T, N] each
    weight = _randn(hidden, scale=0.3)
    expect_sum, expect_norm = ref_norm.add_rms_norm(x, delta, weight, EPS)
    for warps in ADD_NORM_WARPS_SWEEP:
        got_sum, got_norm = tri_norm.add_rms_norm(x, delta, weight, EPS, num_warps=warps)
        _check(f"add_rms_norm sum, {warps} warps", got_sum, expect_sum)
        _check(f"add_rms_norm normed, {warps} warps", got_norm, expect_norm)
    minimal = (4 * tokens * hidden + hidden) * x.element_size()
    print(f"add_rms_norm  T={tokens} N={hidden} bf16 (minimal traffic {minimal / 1e6:.1f} MB)")

    def unfused():
        return tri_norm.rms_norm(x + delta, weight, EPS)

    today = Timed("torch add + Triton rms_norm (before)", bench_graph(unfused), minimal)
    all_torch = Timed("torch reference add + norm", bench_graph(lambda: ref_norm.add_rms_norm(x, delta, weight, EPS)),
                      minimal)
    default = Timed("fused, default warps", bench_graph(lambda: tri_norm.add_rms_norm(x, delta, weight, EPS)), minimal)
    swept = [Timed(f"fused, {warps} warps",
                   bench_graph(lambda warps=warps: tri_norm.add_rms_norm(x, delta, weight, EPS, num_warps=warps)),
                   minimal)
             for warps in ADD_NORM_WARPS_SWEEP]
    best = min(swept, key=lambda t: t.ms)
    for row in (today, all_torch, default, Timed("best: " + best.name, best.ms, minimal)):
        print(row.line())
    return today, min(default, best, key=lambda t: t.ms)


def bench_conv_decode(batch: int, channels: int, before: str | None) -> None:
    """Ours (default, best swept), an earlier kernel (`before`), fla's update, after a check of each."""
    K = 4
    x = _randn(batch, channels)  # [B, D]
    weight = _randn(channels, K, scale=0.5)
    pool = ref_conv.conv_state_zeros(2 * batch, channels, K, DTYPE, "cuda")  # [S, D, K-1], the pools' layout
    pool.copy_(_randn(2 * batch, channels, K - 1))
    channel_major = pool.contiguous()  # for comparison, channel-major: K-1 entries contiguous per channel
    slots = torch.randperm(2 * batch, device="cuda")[:batch]
    expect_state = pool.clone()
    expect = ref_conv.causal_conv1d_decode(x, weight, None, expect_state, slots)

    def checked(name, decode):
        state = pool.clone()
        _check(name, decode(x, weight, None, state, slots), expect)
        _check(f"{name} state", state, expect_state)

    minimal = (2 * batch * channels + 2 * batch * channels * (K - 1)) * x.element_size()
    print(f"conv1d decode  B={batch} D={channels} K={K} bf16 (minimal traffic {minimal / 1e6:.1f} MB)")
    rows = []
    old = importlib.import_module(before).causal_conv1d_decode if before else None
    if old is not None:  # every check before any timing: the timed replays shift the pool
        checked("before", old)
    checked("ours", tri_conv.causal_conv1d_decode)
    state = channel_major.clone()
    _check("ours, channel-major", tri_conv.causal_conv1d_decode(x, weight, None, state, slots), expect)
    _check("ours, channel-major state", state, expect_state)
    for launch in CONV_DECODE_SWEEP:
        checked(f"ours {launch}", lambda *a, launch=launch: tri_conv.causal_conv1d_decode(*a, launch))
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
    except ImportError:
        causal_conv1d_update = None
        print("  (fla-core not installed: no peer row)")
    else:
        # [B, D, K]: its update shifts left first, then puts x last — entry 0 is dropped unread.
        cache = torch.cat([torch.zeros_like(x)[:, :, None], pool[slots]], dim=-1).contiguous()
        fla_out, _ = causal_conv1d_update(x, cache.clone(), weight=weight, activation="silu")
        _check("fla causal_conv1d_update", fla_out, expect)
        causal_conv1d_update(x, cache, weight=weight, activation="silu")  # autotune outside the graph
    if old is not None:
        rows.append(Timed(f"before ({before})", bench_graph(lambda: old(x, weight, None, pool, slots)), minimal))
    rows.append(Timed("ours, channel-major state [S, D, K-1] contiguous",
                      bench_graph(lambda: tri_conv.causal_conv1d_decode(x, weight, None, channel_major, slots)), minimal))
    rows.append(Timed(f"ours, default (block_d {tri_conv.DEFAULT_DECODE_LAUNCH.block_d}, "
                      f"{tri_conv.DEFAULT_DECODE_LAUNCH.num_warps} warps)",
                      bench_graph(lambda: tri_conv.causal_conv1d_decode(x, weight, None, pool, slots)), minimal))
    swept = [Timed(f"ours (block_d {launch.block_d}, {launch.num_warps} warps)",
                   bench_graph(lambda launch=launch: tri_conv.causal_conv1d_decode(x, weight, None, pool, slots, launch)),
                   minimal) for launch in CONV_DECODE_SWEEP]
    best = min(swept, key=lambda t: t.ms)
    rows.append(Timed("best: " + best.name, best.ms, minimal))
    if causal_conv1d_update is not None:
        rows.append(Timed("fla causal_conv1d_update ([B, D, K] cache, no slots)",
                          bench_graph(lambda: causal_conv1d_update(x, cache, weight=weight, activation="silu")), minimal))
    for row in rows:
        print(row.line())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="rows (decode batch)")
    parser.add_argument("--intermediate", type=int, default=17408, help="dense MLP intermediate size")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--layers", type=int, default=64, help="for the per-step saving estimate")
    parser.add_argument("--conv-channels", type=int, default=10240, help="GDN conv channels (2·16·128 + 48·128)")
    parser.add_argument("--conv-before", default=None, help="module with an earlier causal_conv1d_decode to A/B")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    silu_before, silu_after = bench_silu_mul(args.tokens, args.intermediate)
    norm_before, norm_after = bench_add_rms_norm(args.tokens, args.hidden)
    bench_conv_decode(args.tokens, args.conv_channels, args.conv_before)
    saved_ms = args.layers * ((silu_before.ms - silu_after.ms) + 2 * (norm_before.ms - norm_after.ms))
    print(f"estimated saving per {args.layers}-layer decode step: {saved_ms:.3f} ms "
          f"(activation {args.layers * (silu_before.ms - silu_after.ms):.3f}, "
          f"add + norm {2 * args.layers * (norm_before.ms - norm_after.ms):.3f})")


if __name__ == "__main__":
    main()
