"""Where one engine decode step's time goes, against its byte roofline (H200).

    python -m benchmarks.decode_profile                      # qwen3.5-27b, 64 layers, batch 256
    python -m benchmarks.decode_profile --layers 8 --batch 64
    python -m benchmarks.decode_profile --preset tiny --device cpu --batch 8   # smoke run of the script

The real Engine runs `--batch` prompts of `--prompt-len` random tokens to `--output-tokens` each.
Every decode-only step is split, with a device sync between phases, into: scheduling, building
the batch (host), the forward (a CUDA-graph replay when graphs are on), sampling + stop checks.
Then torch.profiler records a few decode-only steps, with graphs and without, and the kernels'
device time per step is grouped by family (GEMMs, ReplaySSM, attention, norms, ...). The
roofline is engine_arms.decode_bytes (weights + KV + state bytes) / copy bandwidth.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from benchmarks.engine_arms import COPY_BANDWIDTH, build_model, decode_bytes

# Kernel-name fragments → family, first match wins (Triton kernels keep their Python names).
FAMILIES = [
    ("replay_flush", ("_replay_flush", "flush")),
    ("replay_step", ("_replay_step", "replay")),
    ("gdn_decode", ("gdn_decode", "_decode_tile", "persistent")),
    ("attention", ("attention", "attn", "flash")),
    ("conv1d", ("conv",)),
    ("norm", ("rms", "norm")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas")),
    ("sampling", ("argmax", "sort", "softmax", "topk", "max_")),
    ("copy/cast", ("copy", "cast", "fill", "index", "gather", "scatter", "cat")),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, fragments in FAMILIES:
        if any(f in low for f in fragments):
            return fam
    return "other"


class StepPhases:
    """Wraps the engine's step pieces with synced timers; keeps decode-only steps."""

    def __init__(self, engine: Engine, sync) -> None:
        self.engine, self.sync = engine, sync
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.on_decode_step = None  # optional hook(step_index) called before a decode-only step
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "decode", "forward")
        self._wrap(engine, "_sample_and_stop", "sample_stop")
        inner_step, inner_schedule = engine._step, engine.scheduler.schedule

        def schedule():
            plan = inner_schedule()
            self.current["batch"] = len(plan.decode)
            self.current["prefill"] = len(plan.prefill)
            return plan

        def step():
            self.current = defaultdict(float)
            self.sync()
            start = time.perf_counter()
            done = inner_step()
            self.sync()
            self.current["total"] = time.perf_counter() - start
            self.steps.append(dict(self.current))
            return done

        engine.scheduler.schedule, engine._step = schedule, step

    def _wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                self.current[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def decode_report(self, min_batch: int) -> dict[str, float]:
        steps = [s for s in self.steps if not s.get("prefill") and s.get("batch", 0) >= min_batch]
        if not steps:
            return {}
        med = lambda key: 1e3 * statistics.median(s.get(key, 0.0) for s in steps)  # noqa: E731
        total, forward, sample = med("total"), med("forward"), med("sample_stop")
        return {"steps": len(steps), "batch": statistics.median(s["batch"] for s in steps),
                "total_ms": total, "schedule_ms": med("schedule"), "forward_ms": forward,
                "sample_stop_ms": sample, "other_host_ms": total - med("schedule") - forward - sample}


def kernel_table(engine: Engine, requests: list[Request], skip_steps: int, record_steps: int,
                 trace_path: str | None = None) -> tuple[dict, dict]:
    """Device time per decode-only step (µs) by family and by kernel, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    seen = {"decode_steps": 0}
    inner = engine._step
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    state = {"on": False, "done": False}

    def step():
        plan_is_decode_only = not engine.scheduler.waiting and all(
            seq.pending == 1 for seq in engine.scheduler.running)
        if plan_is_decode_only and not state["done"]:
            seen["decode_steps"] += 1
            if seen["decode_steps"] == skip_steps + 1:
                prof.__enter__()
                state["on"] = True
        out = inner()
        if state["on"] and seen["decode_steps"] == skip_steps + record_steps:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            state["on"], state["done"] = False, True
        return out

    engine._step = step
    try:
        for _ in engine.generate(requests):
            pass
    finally:
        engine._step = inner
    if not state["done"]:
        return {}, {}
    if trace_path:
        prof.export_chrome_trace(trace_path)
    per_family: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0)
        if device_us <= 0 or event.key.startswith(("cudaGraphLaunch", "cuda")):
            continue
        per_kernel[event.key] = device_us / record_steps
        per_family[family(event.key)] += device_us / record_steps
    return dict(per_family), per_kernel


def gap_report(trace_path: str, top: int = 12) -> None:
    """Idle device time between consecutive kernels of the recorded steps, and where it falls."""
    import json

    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if len(kernels) < 2:
        print("  no kernels in the trace")
        return
    gaps = []  # (idle µs before the kernel, previous kernel, kernel)
    busy, end = 0.0, kernels[0]["ts"]
    for prev, cur in zip(kernels, kernels[1:]):
        gaps.append((cur["ts"] - (prev["ts"] + prev["dur"]), prev["name"], cur["name"]))
    for k in kernels:
        busy += k["dur"]
        end = max(end, k["ts"] + k["dur"])
    span = end - kernels[0]["ts"]
    small = [g for g, _, _ in gaps if 0 < g < 1000]  # between kernels of one step (not host waits)
    print(f"  {len(kernels)} device ops over {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms; "
          f"gaps < 1 ms: {len(small)}, sum {sum(small) / 1e3:.2f} ms, median {statistics.median(small) if small else 0:.1f} µs")
    by_pair: dict[tuple[str, str], list[float]] = defaultdict(list)
    for g, a, b in gaps:
        if 0 < g < 1000:
            by_pair[(a[:50], b[:50])].append(g)
    print("  largest gap sums (previous op → next op):")
    for (a, b), gs in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"    {sum(gs) / 1e3:7.3f} ms  {len(gs):5d}×  {a} → {b}")


def replay_only_ms(engine: Engine, batch: int, reps: int = 10) -> float | None:
    """Median time of the bucket graph replayed alone (inputs as the last step left them)."""
    graphs = engine.runner.decode_graphs
    if graphs is None or batch not in graphs._graphs:
        return None
    graph = graphs._graphs[batch]
    times = []
    for _ in range(reps + 2):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times[2:])


def replay_check(engine: Engine, batch: int, reps: int = 10) -> None:
    """The bucket graph replayed alone: event time without and with torch.profiler attached, the
    profiler's kernel-time sum, and the SM / memory clocks and power while it runs."""
    import subprocess

    from torch.profiler import ProfilerActivity, profile

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active",
                            "--format=csv,noheader", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    plain = replay_only_ms(engine, batch, reps * 3)
    smi.terminate()
    samples = smi.communicate()[0].strip().splitlines()
    print(f"  replay alone: {plain:.2f} ms; nvidia-smi during it (sm MHz, mem MHz, W, throttle): "
          + " | ".join(samples[len(samples) // 3::max(1, len(samples) // 4)][:4]))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled = replay_only_ms(engine, batch, reps)
    per_kernel = {e.key: e.self_device_time_total / (reps + 2) for e in prof.key_averages()}
    print(f"  replay under torch.profiler: {profiled:.2f} ms; kernel time per replay {sum(per_kernel.values()) / 1e3:.2f} ms")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {us / 1e3:8.3f} ms  {name[:100]}")


def make_requests(count: int, prompt_len: int, output_tokens: int, vocab: int, seed: int, tag: str) -> list[Request]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    return [Request(f"{tag}{i}", tuple(rng.randrange(vocab) for _ in range(prompt_len)), params, seed_key=i)
            for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--replayssm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-tables", action="store_true", help="skip the profiler's kernel tables")
    parser.add_argument("--trace-dir", default="/tmp", help="where the profiler's chrome traces go")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    t0 = time.perf_counter()
    model, _ = build_model(args.preset, args.layers, args.device)
    print(f"model built in {time.perf_counter() - t0:.0f} s")
    engine = Engine(model, EngineConfig(device=args.device, max_running=args.batch, replayssm=args.replayssm,
                                        cuda_graphs=cuda), model_name=args.preset)
    vocab = model.config.vocab_size
    for _ in engine.generate(make_requests(4, 64, 4, vocab, 1, "warm")):  # compile, capture
        pass
    phases = StepPhases(engine, sync)
    for _ in engine.generate(make_requests(args.batch, args.prompt_len, args.output_tokens, vocab, 2, "a")):
        pass
    report = phases.decode_report(min_batch=args.batch)
    context = args.prompt_len + args.output_tokens / 2
    roofline_ms = 1e3 * decode_bytes(model, args.replayssm, args.batch, context) / COPY_BANDWIDTH
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    tables = {}
    replay_ms = replay_only_ms(engine, args.batch) if cuda else None
    if cuda:
        replay_check(engine, args.batch)
    if cuda and not args.no_tables:
        engine.scheduler.schedule = type(engine.scheduler).schedule.__get__(engine.scheduler)
        for label in ("graphs", "eager"):
            if label == "eager":
                engine.runner.decode_graphs = None
            reqs = make_requests(args.batch, args.prompt_len, 12, vocab, 3 if label == "graphs" else 4, label)
            tables[label] = kernel_table(engine, reqs, skip_steps=3, record_steps=4,
                                         trace_path=f"{args.trace_dir}/decode_{label}.json")

    for label, (fams, kernels) in tables.items():
        if not fams:
            print(f"\n{label}: no decode-only steps were profiled")
            continue
        print(f"\nkernels per decode step ({label}), top 20 by device time:")
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:20]:
            print(f"  {us / 1e3:8.3f} ms  {name[:110]}")
        gap_report(f"{args.trace_dir}/decode_{label}.json")
        print(f"by family ({label}): " + ", ".join(f"{f} {us / 1e3:.2f}" for f, us in
                                                    sorted(fams.items(), key=lambda kv: -kv[1]))
              + f"; total {sum(fams.values()) / 1e3:.2f} ms")

    print(f"\n{args.preset}, {len(model.config.attn_layer_ids) + len(model.config.gdn_layer_ids)} layers, batch {args.batch}, "
          f"context ~{context:.0f}, replayssm={args.replayssm}")
    print(f"weights {weights / 2**30:.1f} GiB → {1e3 * weights / COPY_BANDWIDTH:.2f} ms at copy bandwidth; "
          f"step roofline {roofline_ms:.2f} ms")
    if report:
        print(f"decode-only steps: {report['steps']} at batch {report['batch']:.0f}; median ms per step:")
        for key in ("total_ms", "schedule_ms", "forward_ms", "sample_stop_ms", "other_host_ms"):
            print(f"  {key:<16} {report[key]:8.2f}")
        print(f"  total / roofline {report['total_ms'] / roofline_ms:.2f}×")
    if replay_ms is not None:
        print(f"graph of batch {args.batch} replayed alone: {replay_ms:.2f} ms")


if __name__ == "__main__":
    main()
