"""Where a long-prompt prefill step spends its time (GPU): torch.profiler's kernel times by family.

    python -m benchmarks.prefill_profile                                  # H200: qwen3.5-27b, 8 layers, 4 x 8192
    python -m benchmarks.prefill_profile --layers 8 --prompts 2 --length 32768 --policies triton,sdpa-cudnn
    python -m benchmarks.prefill_profile --quick                          # CPU smoke run (tiny preset)

The engine prefills `--prompts` random prompts of `--length` tokens (nothing shared, 1 output
token, max_batch_tokens 8,192, no CUDA graphs) under each prefill-attention policy, after a
warm-up prompt of the same length, inside torch.profiler. Kernels are grouped into families by
name (GEMM, attention, GDN, conv, norm / activation / rotary, copies, other); per family the
GPU milliseconds per 8,192 prompt tokens, its share, and the top kernels. `wall` is the timed
generate call per 8,192 tokens: wall minus the summed kernel time is host time and gaps.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from benchmarks.attention_arms.policy import PrefillPolicy
from benchmarks.attention_arms.switch import prefill_policy
from benchmarks.engine_arms import _free, _sync, build_model

STEP_TOKENS = 8192
FAMILIES = [  # (family, substrings of kernel names, lower case); first match wins
    ("attention", ("attn", "fmha", "flash", "cudnn", "sdpa", "softmax")),
    ("gdn", ("gdn", "delta", "chunk", "wy_", "_kkt", "solve_tril", "recompute", "replay", "fwd_h", "fwd_o")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas", "matmul", "_mm_", "fp8")),
    ("conv", ("conv",)),
    ("norm/act/rope", ("norm", "silu", "rope", "rotary", "gate", "sigmoid", "act")),
    ("copy/index", ("copy", "index", "gather", "scatter", "cat", "fill", "elementwise", "memcpy", "memset")),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def profile_policy(model, policy: PrefillPolicy, prompts: int, length: int, device: str) -> dict:
    vocab = model.config.vocab_size
    rng = random.Random(1)
    engine = Engine(model, EngineConfig(device=device, max_batch_tokens=STEP_TOKENS, cuda_graphs=False,
                                        max_model_len=max(length + 16, 4096)), model_name="profile")
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    warm = [Request("warm", tuple(rng.randrange(vocab) for _ in range(length)), one)]
    timed = [Request(i, tuple(rng.randrange(vocab) for _ in range(length)), one) for i in range(prompts)]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with prefill_policy(policy):
        for _ in engine.generate(warm):
            pass
        _sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in engine.generate(timed):
                pass
            _sync(device)
            wall = time.perf_counter() - start
    del engine
    _free(device)
    per_step = STEP_TOKENS / (prompts * length)  # scale to one 8,192-token step
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = event.self_device_time_total if device == "cuda" else 0.0
        if us and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.key] += us / 1e3 * per_step
    families: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        families[family(name)] += ms
    return {"policy": policy.backend, "wall_ms": 1e3 * wall * per_step, "kernel_ms": sum(kernels.values()),
            "families": dict(families), "top": sorted(kernels.items(), key=lambda kv: -kv[1])[:12]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-27b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--policies", default="triton,sdpa-cudnn")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        args.preset, args.layers, args.prompts, args.length = "tiny", 4, 2, 512
    model, raw = build_model(args.preset, args.layers, device)
    rows = [profile_policy(model, PrefillPolicy(name, min_run=1024), args.prompts, args.length, device)
            for name in args.policies.split(",")]
    for r in rows:
        print(f"\n[{r['policy']}] top kernels, ms per {STEP_TOKENS}-token step:")
        for name, ms in r["top"]:
            print(f"  {ms:9.2f}  {family(name):<14} {name[:110]}")
    print(f"\n{args.preset}, {args.layers} layers, {args.prompts} x {args.length} prompt tokens; "
          f"ms per {STEP_TOKENS}-token step (scale by 64 / layers for the full model's layer work)")
    fams = [f for f, _ in FAMILIES] + ["other"]
    print(f"{'policy':<12} {'wall':>8} {'kernels':>8} " + " ".join(f"{f:>14}" for f in fams))
    for r in rows:
        print(f"{r['policy']:<12} {r['wall_ms']:8.1f} {r['kernel_ms']:8.1f} "
              + " ".join(f"{r['families'].get(f, 0.0):14.1f}" for f in fams))


if __name__ == "__main__":
    main()
