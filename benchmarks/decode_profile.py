"""Where one engine decode step's time goes, against its floors (H200).

    python -m benchmarks.decode_profile                      # qwen3.5-27b, 64 layers, batch 256
    python -m benchmarks.decode_profile --layers 8 --batch 64
    python -m benchmarks.decode_profile --preset tiny --device cpu --batch 8   # smoke run of the script

1. The real Engine runs `--batch` prompts of `--prompt-len` random tokens (after a shared
   prefix with `--shared-prefix`) to `--output-tokens` each, as it runs by default (decode
   overlap: the median wall time per decode-only step at the full batch); then the same prompts
   again one step at a time, each step split (host_overhead.PhaseTimer, with a device sync
   between phases) into scheduling, the forward (the runner's decode: a CUDA-graph replay),
   sampling + stop checks, and the rest.
   With `--trace-steps N`, torch.profiler records N of the overlapped full-batch steps (after a
   few): device time per step split into kernels by family, copies and idle gaps (the largest
   listed with the ops around them), and the host's waits — what the engine step adds to the
   bare graph replay.
2. Then, on exactly the inputs of the last step (the bucket graph's static batch): the graph
   replayed alone (with the SM clock, power and throttle reasons while it runs), the same
   forward run eagerly, and torch.profiler over graph replays — kernels by family, the top
   kernels, and the idle gaps between kernels.
Floors: bytes (engine_arms.decode_bytes: weights + KV + state) / copy bandwidth, and FLOPs
(engine_arms.decode_flops) / measured bf16 matrix rate. At batch 256 a dense 27B model's
matrix products are compute-bound (256 FLOP per weight byte > the H200's ~160 at measured
rates), so the byte roofline alone is not reachable there.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
from collections import defaultdict

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from benchmarks.decode_attention_probe import print_probe, probe
from benchmarks.engine_arms import COPY_BANDWIDTH, MATMUL_RATE, build_model, decode_bytes, decode_flops
from benchmarks.gpu_clocks import ClockSampler
from benchmarks.host_overhead import PhaseTimer

# Kernel-name fragments → family, first match wins (Triton kernels keep their Python names).
FAMILIES = [
    ("replay_ssm", ("replay_step", "replay_fold")),
    ("gdn_decode", ("gdn_decode", "_decode_tile")),
    ("attention", ("attn",)),
    ("conv1d", ("conv",)),
    ("norm", ("rms", "norm")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitkreduce")),
    ("elementwise", ("elementwise", "reduce_kernel", "catarray", "index", "silu_mul")),
]


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, fragments in FAMILIES if any(f in low for f in fragments)), "other")


def decode_report(timer: PhaseTimer, batch: int) -> dict[str, float]:
    """Median ms per decode-only step at exactly `batch` sequences."""
    steps = [s for s in timer.steps
             if not s.get("prefill_seqs") and s.get("decode_batch") == batch and not s.get("traced")]
    if not steps:
        return {}
    med = lambda key: 1e3 * statistics.median(s.get(key, 0.0) for s in steps)  # noqa: E731
    report = {key: med(key) for key in ("total", "schedule", "forward", "sample_stop")}
    report["other_host"] = report["total"] - report["schedule"] - report["forward"] - report["sample_stop"]
    return {"steps": len(steps), **report}


def timed_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median CUDA-event time of fn() after warm-up."""
    times = []
    for i in range(warmup + reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def clocks_while(fn) -> str:
    """nvidia-smi samples (SM MHz, W, throttle reasons) taken while fn() runs."""
    with ClockSampler() as clocks:
        fn()
    return clocks.summary()


def load_trace(path: str) -> tuple[list[dict], list[dict]]:
    """(all events, the device ops — kernels, copies, memsets — in time order) of a chrome trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ops = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    return events, ops


def gap_report(trace_path: str, top: int = 8) -> None:
    """Idle device time between consecutive device ops of a profiler trace, and where it falls."""
    _, ops = load_trace(trace_path)
    if len(ops) < 2:
        print("  no device ops in the trace")
        return
    by_pair: dict[tuple[str, str], list[float]] = defaultdict(list)
    for prev, cur in zip(ops, ops[1:]):
        gap = cur["ts"] - (prev["ts"] + prev["dur"])
        if 0 < gap < 1000:  # between kernels of one replay, not between replays
            by_pair[(prev["name"][:50], cur["name"][:50])].append(gap)
    gaps = [g for gs in by_pair.values() for g in gs]
    print(f"  {len(ops)} device ops, busy {sum(o['dur'] for o in ops) / 1e3:.2f} ms; gaps < 1 ms: {len(gaps)}, "
          f"sum {sum(gaps) / 1e3:.2f} ms, median {statistics.median(gaps) if gaps else 0:.1f} µs")
    for (a, b), gs in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"    {sum(gs) / 1e3:7.3f} ms  {len(gs):5d}×  {a} → {b}")


def trace_engine_steps(engine: Engine, timer: PhaseTimer, batch: int, count: int, path: str, skip: int = 3) -> None:
    """Profile `count` overlapped decode-only steps at `batch` (after `skip` of them)."""
    from torch.profiler import ProfilerActivity, profile

    inner = engine._step
    seen = {"steps": 0, "prof": None}

    def step():
        done = inner()
        last = timer.steps[-1] if timer.steps else {}
        if seen["prof"] is not None:
            last["traced"] = True  # profiled: slower, left out of the step-time median
        if not last.get("prefill_seqs") and last.get("decode_batch") == batch:
            seen["steps"] += 1
            if seen["steps"] == skip:
                seen["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                seen["prof"].start()
            elif seen["steps"] == skip + count and seen["prof"] is not None:
                torch.cuda.synchronize()
                seen["prof"].stop()
                seen["prof"].export_chrome_trace(path)
                seen["prof"] = None
                seen["done"] = True
        return done

    engine._step = step
    return seen


def engine_trace_report(path: str, steps: int, top: int = 10) -> None:
    """What an overlapped engine step spends on the device besides the graph's kernels."""
    events, ops = load_trace(path)
    if len(ops) < 2:
        print("  engine trace: no device ops")
        return
    span = ops[-1]["ts"] + ops[-1]["dur"] - ops[0]["ts"]
    busy: dict[str, float] = defaultdict(float)
    for op in ops:
        key = family(op["name"]) if op["cat"] == "kernel" else op["name"].split(" (")[0]
        busy[key] += op["dur"]
    gaps = []
    end = ops[0]["ts"] + ops[0]["dur"]
    for prev, cur in zip(ops, ops[1:]):
        end = max(end, prev["ts"] + prev["dur"])
        if cur["ts"] > end:
            gaps.append((cur["ts"] - end, prev["name"][:40], cur["name"][:40]))
    idle = sum(g for g, _, _ in gaps)
    print(f"engine trace, {steps} overlapped steps: device span {span / 1e3 / steps:.2f} ms per step, busy "
          f"{sum(busy.values()) / 1e3 / steps:.2f}, idle {idle / 1e3 / steps:.2f} ({len(gaps)} gaps)")
    print("  device ms per step: " + ", ".join(f"{k} {v / 1e3 / steps:.3f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])))
    for gap, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"    gap {gap:8.1f} µs  {a} → {b}")
    waits: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(w in e.get("name", "") for w in ("Synchronize", "Memcpy", "GraphLaunch",
                                                                                  "HostAlloc", "LaunchKernel")):
            waits[e["name"]].append(e["dur"])
    print("  host runtime calls per step: " + ", ".join(
        f"{name} {len(d) / steps:.1f}× {sum(d) / 1e3 / steps:.3f} ms" for name, d in sorted(waits.items(), key=lambda kv: -sum(kv[1]))[:8]))


def profile_bucket(engine: Engine, batch: int, trace_path: str, reps: int = 10) -> dict[str, float]:
    """The bucket graph on the last step's inputs: alone, eagerly, and kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.decode_graphs
    graph = graphs._graphs[batch]
    static_batch = graphs._batch(batch)
    result = {}
    clocks = clocks_while(lambda: result.__setitem__("graph", timed_ms(graph.replay, reps * 3)))
    result["eager"] = timed_ms(lambda: engine.model.forward(static_batch, graphs.caches), reps)
    print(f"bucket {batch} on the last step's inputs: graph replay {result['graph']:.2f} ms, "
          f"eager forward {result['eager']:.2f} ms; during the replays (SM MHz, W, throttle): {clocks}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    per_kernel = {e.key: e.self_device_time_total / reps for e in prof.key_averages() if e.self_device_time_total > 0}
    families: dict[str, float] = defaultdict(float)
    for name, us in per_kernel.items():
        families[family(name)] += us
    result["kernels"] = sum(per_kernel.values()) / 1e3
    print(f"kernels per replay: {result['kernels']:.2f} ms; by family: " + ", ".join(
        f"{f} {us / 1e3:.2f}" for f, us in sorted(families.items(), key=lambda kv: -kv[1])))
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:14]:
        print(f"    {us / 1e3:8.3f} ms  {name[:100]}")
    small = [(name, us) for name, us in per_kernel.items() if family(name) in ("elementwise", "other")]
    print("  elementwise / other kernels: " + "; ".join(
        f"{us / 1e3:.3f} {name[:70]}" for name, us in sorted(small, key=lambda kv: -kv[1])[:10]))
    gap_report(trace_path)
    return result


def make_requests(count: int, prompt_len: int, output_tokens: int, vocab: int, seed: int, tag: str,
                  shared_len: int = 0, groups: int = 1) -> list[Request]:
    """`count` prompts of `prompt_len` random tokens; with `shared_len`, each first gets one of
    `groups` random shared prefixes of that length (consecutive prompts share one, as in rag)."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    prefixes = [tuple(rng.randrange(vocab) for _ in range(shared_len)) for _ in range(groups)]
    per_group = -(-count // groups)
    return [Request(f"{tag}{i}", prefixes[i // per_group] + tuple(rng.randrange(vocab) for _ in range(prompt_len)),
                    params, seed_key=i)
            for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of a shared prefix before each prompt (rag: 2048 with --groups 8)")
    parser.add_argument("--groups", type=int, default=1, help="distinct shared prefixes")
    parser.add_argument("--replayssm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                        help="the KV pool's dtype (EngineConfig.kv_cache_dtype)")
    parser.add_argument("--trace", default="/tmp/decode_graph_trace.json", help="the profiler's chrome trace")
    parser.add_argument("--trace-steps", type=int, default=0, help="profile this many overlapped engine steps")
    parser.add_argument("--engine-trace", default="/tmp/decode_engine_trace.json")
    parser.add_argument("--attention-probe", action="store_true",
                        help="time the decode attention on the last step's inputs beside variants "
                             "(benchmarks/decode_attention_probe.py)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    model, _ = build_model(args.preset, args.layers, args.device)
    engine = Engine(model, EngineConfig(device=args.device, max_running=args.batch, replayssm=args.replayssm,
                                        cuda_graphs=cuda, kv_cache_dtype=args.kv_cache_dtype), model_name=args.preset)
    kv_itemsize = engine.config.resolved_kv_dtype().itemsize
    if engine.pool_plan.max_running < args.batch:
        raise SystemExit(f"the memory budget fits {engine.pool_plan.max_running} running requests, not {args.batch}")
    vocab = model.config.vocab_size
    for _ in engine.generate(make_requests(4, 64, 4, vocab, 1, "warm")):  # compile, capture
        pass
    requests = make_requests(args.batch, args.prompt_len, args.output_tokens, vocab, 2, "run",
                             args.shared_prefix, args.groups)
    # As the engine runs (decode overlap on): wall time per step, no syncs.
    overlapped = PhaseTimer(engine, engine.runner, "decode")
    traced = trace_engine_steps(engine, overlapped, args.batch, args.trace_steps, args.engine_trace) \
        if cuda and args.trace_steps else {}
    for _ in engine.generate(requests):
        pass
    steady = decode_report(overlapped, args.batch)
    if traced.get("done"):
        engine_trace_report(args.engine_trace, args.trace_steps)
    # The breakdown: synced phases, one step at a time (overlap off, else the syncs would bill
    # the previous step's GPU time to whichever phase waits first). The prompts now hit the cache.
    engine.config = dataclasses.replace(engine.config, overlap_decode=False)
    engine.stepper.overlap_decode = False  # the step reads its own copy of the setting
    timer = PhaseTimer(engine, engine.runner, "decode", sync)
    for _ in engine.generate([dataclasses.replace(r, request_id=f"again-{r.request_id}") for r in requests]):
        pass
    report = decode_report(timer, args.batch)
    bucket = profile_bucket(engine, args.batch, args.trace) if cuda else {}
    if args.attention_probe and cuda:
        graphs = engine.runner.decode_graphs
        print_probe(probe(graphs._batch(args.batch), graphs.caches.kv_k[0], graphs.caches.kv_v[0],
                          model.config.num_attention_heads))

    own = args.batch * (args.prompt_len + args.output_tokens / 2)
    context = own + args.batch * args.shared_prefix  # KV tokens read per step (per sequence), on average
    byte_ms = 1e3 * decode_bytes(model, args.replayssm, args.batch, context, kv_itemsize=kv_itemsize) / COPY_BANDWIDTH
    # The same with each shared prefix's KV counted once: what a step must read at the least.
    unique_ms = 1e3 * decode_bytes(model, args.replayssm, args.batch, own + args.groups * args.shared_prefix,
                                   kv_itemsize=kv_itemsize) / COPY_BANDWIDTH
    flop_ms = 1e3 * decode_flops(model, args.batch, context) / MATMUL_RATE
    layers = len(model.config.attn_layer_ids) + len(model.config.gdn_layer_ids)
    print(f"\n{args.preset}, {layers} layers, batch {args.batch}, context ~{context / args.batch:.0f} per sequence, "
          f"replayssm={args.replayssm}, KV {args.kv_cache_dtype}")
    print(f"floors: bytes {byte_ms:.2f} ms at {COPY_BANDWIDTH / 1e12:.2f} TB/s; FLOPs {flop_ms:.2f} ms at "
          f"{MATMUL_RATE / 1e12:.0f} TFLOP/s" + (f"; bytes with shared KV counted once {unique_ms:.2f} ms"
                                                 if args.shared_prefix else ""))
    if steady:
        print(f"engine decode-only steps at batch {args.batch}, overlapped as it runs: {steady['steps']}, median "
              f"{steady['total']:.2f} ms per step; step / byte floor {steady['total'] / byte_ms:.2f}×"
              + (f", / floor with shared KV once {steady['total'] / unique_ms:.2f}×" if args.shared_prefix else ""))
        if args.trace_steps:
            # The steps left after the traced ones are no fair sample of an untraced run: on the
            # same kernels they measured faster than all steps of a run without tracing.
            print(f"  (the {args.trace_steps} traced steps are left out of that median: compare step times "
                  "only between runs without --trace-steps)")
    if report:
        print(f"one step at a time, synced phases: {report['steps']} steps; median ms per step: " + ", ".join(
            f"{key} {report[key]:.2f}" for key in ("total", "schedule", "forward", "sample_stop", "other_host")))
        print(f"  step / byte floor {report['total'] / byte_ms:.2f}×; step / max(floors) "
              f"{report['total'] / max(byte_ms, flop_ms):.2f}×")
    if bucket:
        print(f"  graph replay alone {bucket['graph']:.2f} ms (kernels {bucket['kernels']:.2f} ms), "
              f"eager {bucket['eager']:.2f} ms")


if __name__ == "__main__":
    main()
