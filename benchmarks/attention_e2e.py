"""`benchmarks/attention_backends.py --e2e`: model prefill tokens/s with the Triton prefill attention
and with a backend policy side by side, plus the cuBLAS floor of one prefill step's GEMMs.

The qwen3.5-27b preset (bf16, random weights; `--layers` fewer), the engine API, random prompts
(nothing shared), one output token per prompt, max_batch_tokens 8,192. Each arm warms up on one
prompt of the workload's length first (Triton compiles there, not in the timed run).
"""
from __future__ import annotations

import random
import statistics
import time

import torch
import torch.nn.functional as F

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from benchmarks.engine_arms import _free, _sync, build_model
from benchmarks.attention_arms.policy import PrefillPolicy
from benchmarks.attention_arms.switch import prefill_policy

STEP_TOKENS = 8192
GEMM_SUFFIXES = ("in_proj", "out_proj", "qkv_proj", "o_proj", "gate_up", "down", "gate", "shared_gate_up",
                 "shared_down")




def parse_workload(text: str) -> tuple[int, int]:
    count, length = text.lower().split("x")
    return int(count), int(length)


def prefill_rate(model, policy: PrefillPolicy, count: int, length: int, device: str, seed: int,
                 engine_kwargs: dict | None = None) -> dict:
    """Prompt tokens per second of `count` random prompts of `length` tokens under `policy`
    (`engine_kwargs`: further EngineConfig fields, e.g. track_interval)."""
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    config = EngineConfig(device=device, max_batch_tokens=STEP_TOKENS, cuda_graphs=False,
                          max_model_len=max(length + 16, 4096), **(engine_kwargs or {}))
    engine = Engine(model, config, model_name="qwen3.5-27b")
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    warm = [Request("warm", tuple(rng.randrange(vocab) for _ in range(length)), one)]  # every chunk shape once
    timed = [Request(i, tuple(rng.randrange(vocab) for _ in range(length)), one, seed_key=i) for i in range(count)]
    with prefill_policy(policy):
        for _ in engine.generate(warm):
            pass
        before = engine.stats
        _sync(device)
        start = time.perf_counter()
        for _ in engine.generate(timed):
            pass
        _sync(device)
        wall = time.perf_counter() - start
    prompt = engine.stats.prompt_tokens - before.prompt_tokens
    cached = engine.stats.cached_tokens - before.cached_tokens
    del engine
    _free(device)
    tps = (prompt - cached) / wall
    return {"workload": f"{count}x{length}", "policy": label(policy), "prefill_tps": tps, "wall_s": wall,
            "cached_tokens": cached, "step_ms": 1e3 * STEP_TOKENS / tps}


def label(policy: PrefillPolicy) -> str:
    if policy.backend == "triton":
        return "triton (old)"
    extra = ("+rep" if policy.repeat_kv else "") + (f"+{policy.prefix_mask}" if policy.prefix_mask != "lower_right" else "")
    return f"{policy.backend}{extra} (min_run {policy.min_run})"


def gemm_shapes(model) -> dict[tuple[int, int], int]:
    """(out, in) → how many of the step's projection GEMMs have that weight shape."""
    shapes: dict[tuple[int, int], int] = {}
    for name, param in model.named_parameters():
        if param.dim() == 2 and name.split(".")[-1] in GEMM_SUFFIXES:
            shapes[tuple(param.shape)] = shapes.get(tuple(param.shape), 0) + 1
    return shapes


def gemm_floor(model, device: str, tokens: int, reps: int) -> list[dict]:
    """cuBLAS (F.linear) time of each projection shape at `tokens` rows, times its count."""
    rows = []
    dtype = next(model.parameters()).dtype
    for (out_f, in_f), count in sorted(gemm_shapes(model).items()):
        x = torch.randn(tokens, in_f, device=device, dtype=dtype)
        w = torch.randn(out_f, in_f, device=device, dtype=dtype)
        for _ in range(3):
            F.linear(x, w)
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                F.linear(x, w)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                F.linear(x, w)
                times.append(1e3 * (time.perf_counter() - t0))
        ms = statistics.median(times)
        rows.append({"shape": f"{tokens}x{in_f} · {in_f}x{out_f}", "count": count, "ms": ms,
                     "total_ms": ms * count, "tflops": 2 * tokens * in_f * out_f / ms / 1e9})
        del x, w
    _free(device)
    return rows


def run_e2e(args, device: str) -> None:
    layers = args.layers or (4 if args.quick else None)
    model, raw = build_model("tiny" if device == "cpu" else "qwen3.5-27b", layers, device)
    new = PrefillPolicy(args.policy, min_run=args.min_run, repeat_kv=args.repeat_kv,
                            prefix_mask=args.prefix_mask)
    workloads = [parse_workload(w) for w in args.workloads.split(",")]
    if args.quick:
        workloads = [(2, 256), (1, 1024)]
    rows = []
    for count, length in workloads:
        for policy in (PrefillPolicy("triton"), new):
            rows.append(prefill_rate(model, policy, count, length, device, seed=len(rows)))
            r = rows[-1]
            print(f"{r['workload']:<10} {r['policy']:<32} {r['prefill_tps']:12,.0f} tok/s  "
                  f"{r['step_ms']:8.1f} ms/8k-step  (cached {r['cached_tokens']})", flush=True)
    gemms = gemm_floor(model, device, 256 if args.quick else STEP_TOKENS, args.reps)
    floor = sum(g["total_ms"] for g in gemms)
    print()
    print(f"{raw.get('num_hidden_layers')} layers, {next(model.parameters()).dtype} ({device}); prefill tokens/s (prompt tokens not cached / wall)")
    print(f"{'workload':<10} {'attention path':<32} {'tok/s':>12} {'ms/8k-step':>11} {'GEMM floor ms':>14} {'x floor':>8}")
    for r in rows:
        print(f"{r['workload']:<10} {r['policy']:<32} {r['prefill_tps']:12,.0f} {r['step_ms']:11.1f} "
              f"{floor:14.1f} {r['step_ms'] / floor:8.2f}")
    print()
    print(f"GEMMs of one {STEP_TOKENS if not args.quick else 256}-token step through cuBLAS (F.linear), summed: "
          f"{floor:.1f} ms")
    for g in gemms:
        print(f"  {g['shape']:<28} x{g['count']:<3} {g['ms']:8.3f} ms  {g['tflops']:7.1f} TFLOP/s  "
              f"→ {g['total_ms']:8.1f} ms")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"prefill": rows, "gemms": gemms, "gemm_floor_ms": floor}, f, indent=2)
