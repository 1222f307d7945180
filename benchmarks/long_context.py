"""Long prompts without sharing (GPU): prefill at 8k and 32k, 8k in / 1k out, per prefill-attention policy.

    python -m benchmarks.long_context                                   # H200: qwen3.5-27b, 64 layers, bf16
    python -m benchmarks.long_context --policies triton,sdpa-cudnn --prefill 16x8192,2x32768 --gen 48x8192x1024
    python -m benchmarks.long_context --prefill '' --gen 48x8192x1024,96x8192x1024@96   # the batch size
    python -m benchmarks.long_context --quick                           # CPU smoke run (tiny preset)

One random-weight model, a fresh engine per row (benchmarks/attention_e2e.py `prefill_rate`:
1 output token, max_batch_tokens 8,192, so a 32k prompt runs as four chunks after its own
cached prefix). Then `--gen`: N prompts of L tokens generating O tokens each (ignore_eos, CUDA
graphs; max_running N, everything admitted at once, or R with `@R`: a job larger than the batch
runs in waves as rows finish), under the policy with the best 8k prefill rate; total
tokens/s = (prompt + output tokens) / wall, the figure SGLang's cookbook publishes. Last the
cuBLAS floor of one 8,192-token prefill step's projection GEMMs. Short table last.
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

from benchmarks.attention_e2e import STEP_TOKENS, gemm_floor, label, parse_workload, prefill_rate
from benchmarks.engine_arms import Workload, _free, build_model, run_arm
from benchmarks.job_bound import job_bound
from batchinfer.engine.config import EngineConfig
from batchinfer.jobs.run.environ import environ_set
from benchmarks.attention_arms.policy import PrefillPolicy
from benchmarks.attention_arms.switch import prefill_policy


AUTO = -1  # `@auto` in --gen: max_running left to the engine


def parse_policy(text: str, min_run: int) -> PrefillPolicy:
    """"backend" or "backend:prefix_mask" (e.g. sdpa-cudnn:split)."""
    backend, _, mask = text.partition(":")
    return PrefillPolicy(backend, min_run=min_run, prefix_mask=mask or "lower_right")


def parse_generation(text: str) -> tuple[int, int, int, int | None, dict]:
    """"NxLxO[@R][/field=int...]": N prompts of L tokens, O output tokens each, max_running R
    (default: N, everything admitted at once; `@auto`: the engine's default for the model),
    EngineConfig integer / boolean / string fields set after
    the slashes (e.g. `/track_interval=256`, `/kv_cache_dtype=fp8_e4m3`), and environment variables
    set for that job alone (`/env.BATCHINFER_MOE_SHARED_IN_GROUPED=all`: A/B of a model-level switch
    in one process)."""
    spec, *settings = text.split("/")
    spec, _, running = spec.partition("@")
    count, length, output = (int(v) for v in spec.lower().split("x"))
    overrides = {}
    for item in settings:
        key, _, value = item.partition("=")
        if key.startswith("env."):
            overrides[key] = value
            continue
        default = getattr(EngineConfig(), key)  # AttributeError names a wrong field
        if isinstance(default, str):  # e.g. /kv_cache_dtype=fp8_e4m3
            overrides[key] = value
        else:
            overrides[key] = int(value) if default is None else type(default)(int(value))  # None: an optional int
    if running == "auto":  # the engine's own default for the model (EngineConfig.max_running None)
        return count, length, output, AUTO, overrides
    return count, length, output, int(running) if running else None, overrides


def generation_row(model, policy: PrefillPolicy, count: int, length: int, output: int, device: str,
                   preset: str, track_interval: int, max_running: int | None = None,
                   overrides: dict | None = None, temperature: float = 0.0, layers: int | None = None) -> dict:
    prompts = Workload("long", count, 1, 0, length).prompts(model.config.vocab_size, seed=7)
    running = None if max_running == AUTO else max_running or count
    args = SimpleNamespace(device=device, no_graphs=device != "cuda", max_running=running,
                           max_batch_tokens=None, budget_bytes=None, preset=preset, floor=device == "cuda",
                           temperature=temperature)
    engine_overrides = {k: v for k, v in (overrides or {}).items() if not k.startswith("env.")}
    environment = {k.removeprefix("env."): v for k, v in (overrides or {}).items() if k.startswith("env.")}
    with prefill_policy(policy), environ_set(environment):
        row = run_arm(model, "replay+extra_buffer", prompts, output, args,
                      {"track_interval": track_interval, **engine_overrides})
    settings = "".join(f" {k}={v if isinstance(v, str) else int(v)}" for k, v in (overrides or {}).items())
    # The job's bound on one H200 from FLOPs and bytes, at the rows and step size that ran
    bound = job_bound(preset, count, length, output, kv_cache_dtype=(overrides or {}).get("kv_cache_dtype", "auto"),
                      rows=row["max_running"], step_tokens=(overrides or {}).get("max_batch_tokens"), layers=layers)
    return {"workload": f"{count}x{length} → {output}{settings}", "policy": f"{label(policy)}, track {track_interval}",
            "max_running": row["max_running"], "preemptions": row["preemptions"],
            "wall_s": row["wall_s"],
            "total_tps": row["prompt_tps"] + row["output_tps"], "prompt_tps": row["prompt_tps"], "output_tps": row["output_tps"],
            # the mean step counts the batch's ramp and, beside a prefill, only a step's launch;
            # the full-batch median is the figure to hold against the floor of the same steps
            "decode_ms": row.get("decode_ms"), "full_batch": row.get("full_batch"),
            "full_batch_ms": row.get("full_batch_median_ms"), "floor_ms": row.get("floor_ms"),
            "peak_gib": row["peak_gib"], "bound_tps": bound.in_turn_tok_s, "overlapped_bound_tps": bound.overlapped_tok_s}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-27b")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's (4 with --quick)")
    p.add_argument("--policies", default="triton,sdpa-cudnn:lower_right,sdpa-cudnn:split",
                   help="backend[:prefix_mask], comma-separated")
    p.add_argument("--min-run", type=int, default=1024)
    p.add_argument("--prefill", default="16x8192,2x32768", help="prompts x tokens, comma-separated")
    p.add_argument("--gen", default="48x8192x1024",
                   help="prompts x tokens x output tokens[@max_running], comma-separated ('' to skip)")
    p.add_argument("--track-intervals", default="256",
                   help="engine track_interval values (a prefill chunk ends at each multiple inside the prompt)")
    p.add_argument("--gemm-reps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="CPU smoke: tiny preset, short prompts")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the generation jobs' sampling temperature (0: greedy; >0 spreads a random MoE's routing)")
    args = p.parse_args(argv)
    device = "cpu" if args.quick else "cuda"
    preset = "tiny" if args.quick else args.preset
    if args.quick:
        args.prefill, args.layers = "2x256,1x1024", args.layers or 4
        args.gen = "4x128x8" if args.gen == p.get_default("gen") else args.gen
    start = time.perf_counter()
    model, raw = build_model(preset, args.layers, device)
    print(f"{preset}, {raw['num_hidden_layers']} layers, built in {time.perf_counter() - start:.1f} s", flush=True)
    policies = [parse_policy(text, args.min_run) for text in args.policies.split(",")]
    rows = []
    intervals = [int(v) for v in args.track_intervals.split(",")]
    for count, length in (parse_workload(w) for w in args.prefill.split(",") if w):
        for interval in intervals:
            for policy in policies:
                row = prefill_rate(model, policy, count, length, device, seed=len(rows),
                                   engine_kwargs={"track_interval": interval})
                rows.append({**row, "policy": f"{row['policy']}, track {interval}", "_policy": policy,
                             "_interval": interval})
                print(f"{rows[-1]['workload']:<10} {rows[-1]['policy']:<40} {rows[-1]['prefill_tps']:10,.0f} tok/s",
                      flush=True)
    gen_rows = []
    at_8k = [r for r in rows if r["workload"].endswith("x8192")] or rows
    best = max(at_8k, key=lambda r: r["prefill_tps"]) if at_8k else {"_policy": policies[0], "_interval": intervals[0]}
    for spec in (s for s in args.gen.split(",") if s):
        count, length, output, running, overrides = parse_generation(spec)
        gen_rows.append(generation_row(model, best["_policy"], count, length, output, device, preset,
                                       best["_interval"], running, overrides, args.temperature, args.layers))
        print(f"{gen_rows[-1]['workload']:<18} {gen_rows[-1]['policy']:<40} {gen_rows[-1]['total_tps']:10,.0f} total tok/s",
              flush=True)
    gemms = gemm_floor(model, device, 256 if args.quick else STEP_TOKENS, args.gemm_reps)
    floor = sum(g["total_ms"] for g in gemms)
    del model
    _free(device)
    print()
    print(f"{preset}, {raw['num_hidden_layers']} layers; prefill tok/s = prompt tokens / wall; "
          f"GEMM floor of one {STEP_TOKENS}-token step {floor:.1f} ms (cuBLAS, summed)")
    print(f"{'workload':<12} {'attention policy, track_interval':<40} {'prefill tok/s':>14} {'ms/8k-step':>11} {'x GEMM floor':>13}")
    for r in rows:
        ratio = f"{r['step_ms'] / floor:13.2f}" if floor > 0 else f"{'—':>13}"  # FP8 models: no bf16 GEMM floor
        print(f"{r['workload']:<12} {r['policy']:<40} {r['prefill_tps']:14,.0f} {r['step_ms']:11.1f} {ratio}")
    for r in gen_rows:
        print(f"{r['workload']:<20} max_running {r['max_running']:<4} total {r['total_tps']:,.0f} tok/s "
              f"(prompt {r['prompt_tps']:,.0f}, output {r['output_tps']:,.0f}), wall {r['wall_s']:.1f} s, decode "
              f"{r['decode_ms'] or float('nan'):.1f} ms/step (full batch {r['full_batch'] or 0:.0f}: "
              f"{r['full_batch_ms'] or float('nan'):.1f} ms, floor {r['floor_ms'] or float('nan'):.1f}), "
              f"{r['preemptions']} preemptions, peak {r['peak_gib']:.1f} GiB; H200 bound {r['bound_tps']:,.0f} "
              f"({r['total_tps'] / r['bound_tps']:.0%}), overlapped {r['overlapped_bound_tps']:,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prefill": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows], "generate": gen_rows, "gemms": gemms, "gemm_floor_ms": floor}, f, indent=2)


if __name__ == "__main__":
    main()
