"""Step activations against their estimate, and an engine on a nearly full device (CUDA).

    python -m benchmarks.memory_headroom [--preset qwen3.5-27b] [--layers 8] [--pools-gib 6]

The engine sizes its pools from the free memory and must leave room for the largest step's
transient tensors (batchinfer/engine/build.py:activation_reserve_bytes: the largest eager step
and the decode graphs, from batchinfer/engine/activations.py, with a margin). Three runs of one workload whose steps
are the largest the settings allow — prefill steps of max_batch_tokens, one of them ending
max_running short prompts at once (logits for each), and decode at max_running:

1. a plain engine: the peak memory above its baseline (weights, pools, decode graphs) during the
   workload, allocated and reserved, against the estimate;
2. the device filled first so that `--pools-gib` plus the engine's reserve is left free, with
   the old budget (90% of the free memory, no reserve): does a step run out of memory?
3. the same fill with the reserve: every request should finish.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
from dataclasses import replace

import torch

from batchinfer.engine import Engine, EngineConfig
from batchinfer.engine.activations import decode_graph_bytes, step_activation_bytes
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.engine.cuda_graphs import bucket_sizes
from batchinfer.engine.build import _GRAPH_CTX_CAP as GRAPH_CTX_CAP
from batchinfer.engine.build import activation_reserve_bytes
from benchmarks.engine_arms import build_model

GIB = 2 ** 30


def workload(vocab: int, max_running: int, max_batch_tokens: int) -> list[Request]:
    rng = random.Random(0)
    short_len = max(1, max_batch_tokens // max_running)
    prompts = [[rng.randrange(vocab) for _ in range(short_len)] for _ in range(max_running)]
    prompts += [[rng.randrange(vocab) for _ in range(max_batch_tokens // 2)] for _ in range(8)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return [Request(i, tuple(p), params) for i, p in enumerate(prompts)]


def run(model, config: EngineConfig, requests: list[Request], without_reserve: bool = False) -> dict:
    if without_reserve:  # the budget before the reserve: the fraction of the free memory, nothing kept back
        free, _ = torch.cuda.mem_get_info()
        config = replace(config, memory_budget_bytes=int(free * config.memory_fraction))
    before = torch.cuda.memory_reserved()
    engine = Engine(model, config, model_name="memory_headroom")
    torch.cuda.synchronize()
    base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    result = dict(max_running=engine.pool_plan.max_running, pools_gib=engine.pool_plan.total_bytes / GIB,
                  graphs=engine.runner.decode_graphs is not None,
                  # what construction reserved besides the pools: the decode graphs' private pool
                  graphs_gib=(base_reserved - before - engine.pool_plan.total_bytes) / GIB)
    try:
        result["finished"] = sum(1 for _ in engine.generate(requests))
        torch.cuda.synchronize()
        result["error"] = ""
    except torch.OutOfMemoryError as exc:
        result["finished"] = None
        result["error"] = "OutOfMemoryError: " + str(exc).split(".")[0]
    result["peak_alloc_gib"] = (torch.cuda.max_memory_allocated() - base_alloc) / GIB
    result["peak_reserved_gib"] = (torch.cuda.max_memory_reserved() - base_reserved) / GIB
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pools-gib", type=float, default=6.0)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_headroom needs CUDA")
        return 0
    model, _ = build_model(args.preset, args.layers, "cuda")
    config = EngineConfig(max_running=args.max_running, max_batch_tokens=args.max_batch_tokens)
    max_model_len = model.config.max_position_embeddings
    estimate = activation_reserve_bytes(model.config, config, max_model_len)  # what the engine leaves free
    eager = step_activation_bytes(model.config, torch.bfloat16, args.max_batch_tokens, args.max_running)
    graphs = decode_graph_bytes(model.config, torch.bfloat16, bucket_sizes(args.max_running),
                                min(max_model_len, GRAPH_CTX_CAP))
    requests = workload(model.config.vocab_size, args.max_running, args.max_batch_tokens)
    rows = [("plain device", run(model, config, requests))]

    free, _ = torch.cuda.mem_get_info()
    fill = free - int(estimate + args.pools_gib * GIB)
    blocker = torch.empty(max(0, fill), dtype=torch.uint8, device="cuda")
    print(f"filled {fill / GIB:.1f} GiB: {torch.cuda.mem_get_info()[0] / GIB:.2f} GiB free")
    rows.append(("nearly full, no reserve (before)", run(model, config, requests, without_reserve=True)))
    rows.append(("nearly full, reserve (now)", run(model, config, requests)))
    del blocker

    print(f"\n{args.preset}, {args.layers} layers, max_batch_tokens {args.max_batch_tokens}, max_running "
          f"{args.max_running}: estimated eager step {eager / GIB:.2f} GiB, decode graphs {graphs / GIB:.2f} GiB; "
          f"reserve with the margin {estimate / GIB:.2f} GiB")
    print("peak alloc / reserved: above the memory after construction (weights, pools, graphs); graphs GiB: "
          "what construction reserved besides the pools")
    print(f"{'run':<34}{'running':>8}{'pools GiB':>10}{'graphs GiB':>11}{'finished':>9}{'peak alloc GiB':>15}"
          f"{'peak reserved GiB':>18}  error")
    for name, r in rows:
        finished = "—" if r["finished"] is None else str(r["finished"])
        graphs = f"{r['graphs_gib']:.2f}" if r["graphs"] else "off"
        print(f"{name:<34}{r['max_running']:>8}{r['pools_gib']:>10.2f}{graphs:>11}{finished:>9}"
              f"{r['peak_alloc_gib']:>15.2f}{r['peak_reserved_gib']:>18.2f}  {r['error'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
