"""Pipeline stages on one GPU: the same model as 1 and as 2 stages (both stages on one device).

    python -m benchmarks.pipeline_one_gpu                      # H200: 27B shapes, 16 layers, bf16; then 397B cut
    python -m benchmarks.pipeline_one_gpu --quick              # CPU smoke (tiny preset, fp32)

Per engine: a RAG-shaped job (groups of rows sharing a long document prefix), greedy, with the top
logprobs of every generated token. Compared with the 1-stage engine: the first token's logprobs
(the prefill's logits through the whole model) within bf16 tolerance, the share of identical greedy
texts, hit = the plan's ideal, whether decode steps replayed CUDA graphs (per stage when pipelined)
and how many. Measured: total tok/s, and each stage's busy seconds against the
job's wall (both stages share the one GPU, so the sum, not the max, bounds the step; on several
GPUs the max would). Then a large MoE preset cut to the layers one GPU holds runs as 2 stages end to end.
"""
from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import replace

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.stage_graphs import StageGraphs
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.presets import PRESETS


def cut_preset(name: str, layers: int) -> str:
    """Register `name` cut to its first `layers` layers as a preset of its own; → its name."""
    raw = dict(PRESETS[name])
    raw["num_hidden_layers"] = layers
    if "layer_types" in raw:
        raw["layer_types"] = list(raw["layer_types"])[:layers]
    cut = f"{name}@{layers}"
    PRESETS[cut] = raw
    return cut


def rag_requests(vocab: int, groups: int, per_group: int, prefix: int, suffix: int, out: int) -> list[Request]:
    rng = random.Random(0)
    sampling = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True, logprobs=4)
    requests = []
    for g in range(groups):
        doc = [rng.randrange(vocab) for _ in range(prefix)]
        for q in range(per_group):
            prompt = doc + [rng.randrange(vocab) for _ in range(suffix)]
            requests.append(Request(request_id=(g, q), prompt_token_ids=tuple(prompt), seed_key=g * per_group + q,
                                    sampling=sampling))
    return requests


def warmup_requests(requests: list[Request]) -> list[Request]:
    """An eighth of the job with every token shifted: the same shapes, no prefix shared with the job."""
    vocab = 1 + max(max(r.prompt_token_ids) for r in requests)
    return [replace(r, request_id=("warm-up", r.request_id), prompt_token_ids=tuple((t + 1) % vocab for t in r.prompt_token_ids))
            for r in requests[: max(1, len(requests) // 8)]]


def run_engine(model: str, stages: int, device: str, dtype: str, requests: list[Request], max_running: int) -> dict:
    config = EngineConfig(device=device, dtype=dtype, pipeline_stages=stages, max_running=max_running,
                          memory_fraction=0.8)
    start = time.perf_counter()
    engine = Engine.from_pretrained(model, config)
    built = time.perf_counter() - start
    # warm-up on other documents (first launches compile); their prefixes stay cached but match no measured row
    list(engine.generate(warmup_requests(requests)))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    before = dict(engine.settings().get("pipeline", {}))
    before_stats = engine.stats
    graphs = engine.runner.decode_graphs  # None: decode steps ran eagerly (off, or the capture failed)
    replays_before = graphs.replays if graphs is not None else 0
    start = time.perf_counter()
    outputs = {(o.request_id, o.sample_index): o for o in engine.generate(requests)}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    stats = engine.stats
    pipeline = engine.settings().get("pipeline", {})
    busy = [b - a for a, b in zip(before.get("stage_busy_seconds", []), pipeline.get("stage_busy_seconds", []))]
    tokens = sum(o.prompt_tokens + o.completion_tokens for o in outputs.values())
    row = {"stages": stages, "built_s": built, "wall_s": wall, "total_tps": tokens / wall,
           "cached": stats.cached_tokens - before_stats.cached_tokens,
           "ideal": stats.theoretical_max_cached_tokens - before_stats.theoretical_max_cached_tokens,
           "busy": busy, "split": pipeline.get("stages"), "outputs": outputs,
           "graphs": graphs_used(graphs, replays_before),
           "errors": sum(o.error is not None for o in outputs.values())}
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def graphs_used(graphs, replays_before: int) -> str:
    """Which decode graphs the engine had and how many of the job's decode steps replayed them."""
    if graphs is None:
        return "off"
    kind = "per stage" if isinstance(graphs.forward, StageGraphs) else "whole model"
    return f"{kind}, {graphs.replays - replays_before} replays"


def first_token_gap(a: dict, b: dict) -> float:
    """Largest |logprob difference| of the first generated token's top candidates present in both."""
    gap = 0.0
    for key, out in a.items():
        first_a, first_b = out.logprobs[0], b[key].logprobs[0]
        top_b = dict(zip(first_b.top_ids, first_b.top_logprobs))
        for token, value in zip(first_a.top_ids, first_a.top_logprobs):
            if token in top_b:
                gap = max(gap, abs(value - top_b[token]))
    return gap


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3.5-27b")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--big", default="qwen3.5-397b-a17b", help="the large preset cut to fit ('' to skip)")
    p.add_argument("--big-layers", type=int, default=4)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    device, dtype = ("cpu", "fp32") if args.quick else ("cuda:0", "bf16")
    if args.quick:
        args.preset, args.layers, args.big, args.groups, args.per_group, args.prefix, args.output = \
            "tiny", 4, "", 2, 3, 48, 6
    model = cut_preset(args.preset, args.layers)
    vocab = min(PRESETS[args.preset]["vocab_size"], 32000)
    requests = rag_requests(vocab, args.groups, args.per_group, args.prefix, 32, args.output)
    rows = [run_engine(model, stages, device, dtype, requests, args.max_running) for stages in (1, 2)]
    one, two = rows
    same = sum(one["outputs"][k].token_ids == o.token_ids for k, o in two["outputs"].items())
    gap = first_token_gap(one["outputs"], two["outputs"])
    big = None
    if args.big:
        big_model = cut_preset(args.big, args.big_layers)
        big_requests = rag_requests(min(PRESETS[args.big]["vocab_size"], 32000), 8, 8, 1024, 32, 32)
        big = run_engine(big_model, 2, device, dtype, big_requests, 128)
    print()
    print(f"{model}, {dtype}, {len(requests)} rows ({args.groups} documents x {args.per_group} questions, "
          f"prefix {args.prefix}, output {args.output})")
    print("| stages | split | total tok/s | wall s | stage busy s (sum / wall) | hit / ideal | decode graphs | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows + ([big] if big else []):
        busy = " / ".join(f"{b:.2f}" for b in r["busy"]) or "-"
        share = f" ({sum(r['busy']) / r['wall_s']:.2f})" if r["busy"] else ""
        name = model if r is not big else big_model
        print(f"| {r['stages']} ({name}) | {r['split']} | {r['total_tps']:,.0f} | {r['wall_s']:.2f} | {busy}{share} | "
              f"{r['cached']:,} / {r['ideal']:,} | {r['graphs']} | {r['errors']} |")
    print(f"2 vs 1 stage: first-token top-4 logprob gap {gap:.4f}; identical greedy texts {same}/{len(requests)}; "
          f"hit = ideal: {all(r['cached'] == r['ideal'] for r in rows + ([big] if big else []))}")


if __name__ == "__main__":
    main()
