"""The routed-expert block of one MoE layer at decode batch sizes: the model's path against its floors.

    python -m benchmarks.bench_moe                 # H200: qwen3.5-35b-a3b shapes, batch 16 / 64 / 256
    python -m benchmarks.bench_moe --quick         # CPU smoke run: small shapes, the same code

Per batch B (tokens routed top-k over E experts; router weights random, so routing is roughly
uniform): milliseconds of
  - `SparseMoE.routed` as the model runs it (sort by expert, torch._grouped_mm for gate|up
    and down, silu_mul, fp32 combine), CUDA-graph captured, as decode steps run;
  - the same in eager mode (launch overheads included);
  - the per-expert loop (the fallback: one matmul per routed expert, a host sync for the counts);
  - the two grouped matmuls alone (the GEMM share of the block);
beside the byte floor (the expected unique experts E·(1 − (1 − k/E)^B) of gate|up and down at copy
bandwidth) and the FLOP floor (2·B·k·3·H·I at the bf16 matmul rate). "x floor" is the graph time
over the larger floor.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Optional

import torch

from batchinfer.models.config import model_config_from_dict
from batchinfer.models.layers.mlp import SparseMoE
from batchinfer.models.presets import PRESETS
from batchinfer.models.random_init import init_random_, make_generator
from benchmarks.bench_replay_attn import capture_graph
from benchmarks.bench_utils import print_table, time_ms
from benchmarks.engine_arms import COPY_BANDWIDTH, MATMUL_RATE, expected_unique_experts


def make_block(preset: str, device: str, dtype: torch.dtype, quick: bool) -> SparseMoE:
    raw = dict(PRESETS[preset])
    if quick:
        raw.update(hidden_size=128, num_experts=32, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    block = SparseMoE(model_config_from_dict(raw), dtype, device)
    generator = make_generator(0, device)
    for name, param in block.named_parameters():
        init_random_(param.data, name, 1, generator)
    return block


def graphed(fn: Callable[[], object], device: str) -> Optional[Callable[[], object]]:
    """`fn` captured in a CUDA graph (None: not capturable, e.g. it syncs with the host)."""
    return capture_graph(fn)[0] if device == "cuda" else None


def per_expert_loop(block: SparseMoE, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The fallback path of `_run_experts`, whatever the device supports."""
    from batchinfer.models.layers.mlp import swiglu

    T, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    x_sorted = x[token_of]
    counts = torch.bincount(flat, minlength=block.num_experts)
    y = torch.empty_like(x_sorted)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows = slice(start, start + count)
            y[rows] = swiglu(x_sorted[rows], block.experts_gate_up[expert], block.experts_down[expert])
            start += count
    y = y.float() * weights.reshape(-1)[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token_of, y)


@torch.inference_mode()
def measure(block: SparseMoE, batch: int, device: str, repeats: int) -> dict:
    H = block.experts_down.shape[1]
    I = block.experts_down.shape[2]
    E, k = block.num_experts, block.top_k
    timing = {"rep": max(repeats, 20), "cpu_calls": repeats}
    generator = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, H, device=device, dtype=block.router.dtype, generator=generator)
    experts, weights = block.route(x)
    row = {"batch": batch, "experts": E, "top_k": k, "hidden": H, "moe_intermediate": I}
    model_path = lambda: block.routed(x, experts, weights)  # noqa: E731
    loop = lambda: per_expert_loop(block, x, experts, weights)  # noqa: E731
    torch.testing.assert_close(model_path(), loop(), rtol=2e-2, atol=2e-2)  # same maths, either path
    row["eager_ms"] = time_ms(model_path, device, **timing)
    replay = graphed(model_path, device)
    row["graph_ms"] = time_ms(replay, device, **timing) if replay else float("nan")
    row["loop_ms"] = time_ms(loop, device, **timing)
    if hasattr(torch, "_grouped_mm") and (device == "cpu" or block.router.dtype == torch.bfloat16):
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        x_sorted = x[order // k]
        counts = torch.zeros(E, dtype=torch.int64, device=device).index_add_(0, flat, torch.ones_like(flat))
        offsets = counts.cumsum(0).to(torch.int32)
        mid = torch.randn(batch * k, I, device=device, dtype=x.dtype, generator=generator)

        def gemms():
            torch._grouped_mm(x_sorted, block.experts_gate_up.transpose(1, 2), offs=offsets)
            torch._grouped_mm(mid, block.experts_down.transpose(1, 2), offs=offsets)
        row["grouped_mm_ms"] = time_ms(gemms, device, **timing)
    unique = expected_unique_experts(E, k, batch)
    per_expert = (block.experts_gate_up[0].numel() + block.experts_down[0].numel()) * block.router.element_size()
    row["unique_experts"] = unique
    row["byte_floor_ms"] = 1e3 * unique * per_expert / COPY_BANDWIDTH
    row["flop_floor_ms"] = 1e3 * 2 * batch * k * 3 * H * I / MATMUL_RATE
    best = row["graph_ms"] if row["graph_ms"] == row["graph_ms"] else row["eager_ms"]
    row["x_floor"] = best / max(row["byte_floor_ms"], row["flop_floor_ms"])
    return row


HEADER = (f"{'B':>5} {'uniq E':>7} {'graph ms':>9} {'eager ms':>9} {'loop ms':>9} {'grouped_mm ms':>13} "
          f"{'byte floor':>10} {'flop floor':>10} {'x floor':>8}")


def row_line(r: dict) -> str:
    return (f"{r['batch']:>5} {r['unique_experts']:7.1f} {r['graph_ms']:9.3f} {r['eager_ms']:9.3f} "
            f"{r['loop_ms']:9.3f} {r.get('grouped_mm_ms', float('nan')):13.3f} {r['byte_floor_ms']:10.3f} "
            f"{r['flop_floor_ms']:10.4f} {r['x_floor']:7.1f}x")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--quick", action="store_true", help="CPU, small shapes, batch 4 and 16")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = "cpu" if args.quick else "cuda"
    dtype = torch.float32 if args.quick else torch.bfloat16
    block = make_block(args.preset, device, dtype, args.quick)
    batches = [4, 16] if args.quick else [int(b) for b in args.batches.split(",")]
    rows = [measure(block, b, device, 3 if args.quick else args.repeats) for b in batches]
    print(f"{args.preset}: one MoE layer's routed experts ({rows[0]['experts']} experts, top-{rows[0]['top_k']}, "
          f"hidden {rows[0]['hidden']}, expert intermediate {rows[0]['moe_intermediate']}, {dtype})")
    print_table(HEADER, map(row_line, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
