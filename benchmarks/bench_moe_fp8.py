"""FP8 routed experts of one MoE layer: the grouped FP8 GEMMs (kernels/moe_fp8) against dequantize + `_grouped_mm`.

    python -m benchmarks.bench_moe_fp8            # GPU: qwen3.5-35b-a3b expert shapes, 256 / 512 / 1024 tokens
    python -m benchmarks.bench_moe_fp8 --quick    # CPU smoke run (Triton interpreter, tiny shapes)
    python -m benchmarks.bench_moe_fp8 --sm90     # no GPU: compile both kernels for sm_90a, print resources
    python -m benchmarks.bench_moe_fp8 --parts    # also each part of the FP8 path alone, against its byte floor

Per token count T (routed top-k over E experts by a random router, as `SparseMoE.route` does):
CUDA-graph replay milliseconds of `SparseMoE._run_experts` with the grouped FP8 kernel (the
layout `ops.moe_align` with its row tiles, activation quant, gate|up with SiLU·mul and
re-quantization fused, down) and of `SparseMoE._expert_rows` on the same FP8 block over a layout
made beforehand (both stacks dequantized to bf16, gather, `_grouped_mm`, silu_mul, `_grouped_mm`:
the path before the grouped FP8 kernel). Both produce the same [T·k, hidden] rows, each in its
layout's order (compared per assignment). The byte floor is
the experts the batch routes to (their e4m3 weights and scales read once) plus the activations
(x read, the rows written, bf16); "GB/s" is that floor's bytes over the measured time and
"x floor" the time over the floor at copy bandwidth. The last column is the FP8 path's max error
against the dequantized path, relative to its max.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch

# Without a GPU the kernels run in Triton's interpreter, which must be on before any kernel module
# defines its @triton.jit functions; --sm90 compiles them instead, which the interpreter forbids.
if not torch.cuda.is_available() and "--sm90" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from batchinfer.models.config import model_config_from_dict  # noqa: E402
from batchinfer.models.layers.fp8_linear import Fp8Weight  # noqa: E402
from batchinfer.models.layers.mlp import SparseMoE  # noqa: E402
from batchinfer.models.presets import PRESETS  # noqa: E402
from benchmarks.bench_utils import print_table, time_ms  # noqa: E402

COPY_BANDWIDTH = 4.28e12  # B/s, device-to-device copy measured on the H200 (as benchmarks.engine_arms)
FP8_EXPERTS = frozenset({"experts_gate_up", "experts_down", "shared_expert.gate_up", "shared_expert.down"})


def make_block(preset: str, device: str, quick: bool) -> SparseMoE:
    """The preset's MoE block with FP8 routed and shared experts, as an FP8 checkpoint has them
    (random weights, block-quantized here)."""
    raw = dict(PRESETS[preset])
    if quick:
        raw.update(hidden_size=256, num_experts=8, moe_intermediate_size=128, shared_expert_intermediate_size=128)
    config = model_config_from_dict(raw)
    block = SparseMoE(config, torch.bfloat16, device, FP8_EXPERTS)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        block.router.copy_(torch.randn(block.router.shape, device=device, generator=generator))
        for weight in (block.experts_gate_up, block.experts_down):
            fan_in = weight.shape[-1]
            for e in range(weight.shape[0]):  # one expert at a time: the fp32 staging stays small
                w = torch.randn(weight.shape[1:], device=device, generator=generator) * fan_in ** -0.5
                sub = Fp8Weight(*weight.shape[1:], device=device)
                sub.quantize_from_(w)
                weight.weight[e].copy_(sub.weight)
                weight.scale_inv[e].copy_(sub.scale_inv)
        for weight in (block.shared_expert.gate_up, block.shared_expert.down):
            weight.quantize_from_(torch.randn(weight.shape, device=device, generator=generator) * weight.shape[-1] ** -0.5)
        block.shared_expert_gate.copy_(torch.randn(block.shared_expert_gate.shape, device=device, generator=generator)
                                       * block.shared_expert_gate.shape[-1] ** -0.5)
    return block


def graph_time_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        from benchmarks.bench_replay_attn import capture_graph
        fn = capture_graph(fn)[0] or fn  # decode steps are graphs: no launch overhead in either arm
    return time_ms(fn, device, rep=100)


def floor_bytes(block: SparseMoE, counts: torch.Tensor, tokens: int) -> int:
    hit = int((counts > 0).sum())
    per_expert = sum(w.weight[0].numel() + 4 * w.scale_inv[0].numel()
                     for w in (block.experts_gate_up, block.experts_down))
    H = block.experts_down.shape[1]
    return hit * per_expert + 2 * H * (tokens + tokens * block.top_k)  # weights + x read + rows written


@torch.inference_mode()
def measure(block: SparseMoE, tokens: int, device: str) -> dict:
    H = block.experts_down.shape[1]
    generator = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, H, device=device, generator=generator).bfloat16()
    experts, _ = block.route(x)
    from batchinfer.kernels import ops
    from batchinfer.models.layers import mlp
    layout = ops.moe_align(experts, block.num_experts)
    counts = torch.diff(layout.ends.long(), prepend=layout.ends.new_zeros(1).long())  # [E]
    kernel = ops.implementation("moe_fp8", True)
    fp8_path = lambda: block._run_experts(x, experts)  # noqa: E731
    dequant_path = lambda: block._expert_rows(x, layout.token_of, layout.ends)  # noqa: E731
    original, mlp._grouped_fp8_op = mlp._grouped_fp8_op, (lambda _: kernel)  # the kernel on the CPU too
    try:
        rows, slot = fp8_path()
        fp8_rows = rows.float()[slot.reshape(-1)]  # per assignment (t, j)
        dequant_rows = dequant_path().float()[layout.slot.reshape(-1)]
        fp8_ms, dequant_ms = graph_time_ms(fp8_path, device), graph_time_ms(dequant_path, device)
    finally:
        mlp._grouped_fp8_op = original
    nbytes = floor_bytes(block, counts, tokens)
    floor_ms = 1e3 * nbytes / COPY_BANDWIDTH
    return {"tokens": tokens, "rows": tokens * block.top_k, "experts_hit": int((counts > 0).sum()),
            "floor_mb": nbytes / 1e6, "floor_ms": floor_ms, "fp8_ms": fp8_ms, "dequant_ms": dequant_ms,
            "fp8_gbs": nbytes / fp8_ms / 1e6, "dequant_gbs": nbytes / dequant_ms / 1e6,
            "rel_err": ((fp8_rows - dequant_rows).abs().max() / dequant_rows.abs().max()).item()}


HEADER = (f"{'T':>5} {'rows':>6} {'E hit':>5} {'floor MB':>8} {'floor ms':>8} | {'fp8 ms':>7} {'GB/s':>6} "
          f"{'x floor':>7} | {'deq+gmm ms':>10} {'GB/s':>6} {'x floor':>7} | {'speedup':>7} {'rel err':>8}")


def row_line(r: dict) -> str:
    return (f"{r['tokens']:>5} {r['rows']:>6} {r['experts_hit']:>5} {r['floor_mb']:8.1f} {r['floor_ms']:8.3f} | "
            f"{r['fp8_ms']:7.3f} {r['fp8_gbs']:6.0f} {r['fp8_ms'] / r['floor_ms']:6.2f}x | "
            f"{r['dequant_ms']:10.3f} {r['dequant_gbs']:6.0f} {r['dequant_ms'] / r['floor_ms']:6.2f}x | "
            f"{r['dequant_ms'] / r['fp8_ms']:6.2f}x {r['rel_err']:8.1e}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-35b-a3b")
    parser.add_argument("--tokens", default="256,512,1024")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, 4 and 16 tokens")
    parser.add_argument("--sm90", action="store_true", help="no GPU: compile for sm_90a and print resources")
    parser.add_argument("--launches", default="", help="also time fixed launches in place of default_launch: "
                                                       "BLOCK_M:WARPS:STAGES[:rows][/BLOCK_M:WARPS:STAGES[:BLOCK_N]][+a16|+f16],... "
                                                       "(gate|up / down; e.g. 64:8:4,128:16:3/128:8:3:128,64:8:3+a16; "
                                                       "':rows': programs row tile fastest; '+a16': the W8A16 kernels, '+f16' with fp16 dots)")
    parser.add_argument("--parts", action="store_true",
                        help="also the FP8 path's parts (layout, activation quantization, gate|up, down) by "
                             "leaving each out in turn, the GEMMs against their own byte floors")
    parser.add_argument("--shared-in-grouped", action="store_true",
                        help="also time the whole MoE block with the shared expert separate and in the grouped kernel")
    args = parser.parse_args(argv)
    if args.sm90:
        from benchmarks.moe_fp8_sm90 import print_sm90
        from batchinfer.kernels.moe_fp8.grouped_gemm import parse_launch
        print_sm90([parse_launch(text) for text in args.launches.split(",")] if args.launches else None)
        return 0
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    block = make_block(args.preset, device, args.quick)
    counts = [4, 16] if args.quick else [int(t) for t in args.tokens.split(",")]
    rows = [measure(block, t, device) for t in counts]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"{args.preset} FP8 routed experts: {block.num_experts} experts top-{block.top_k}, hidden "
          f"{block.experts_down.shape[1]}, expert intermediate {block.experts_down.shape[2]}; {name}, "
          f"floor at {COPY_BANDWIDTH / 1e12:.2f} TB/s")
    print_table(HEADER, map(row_line, rows))
    if args.parts:
        print("\nthe FP8 path's parts at the default launch, each the path's time less the path without it:")
        print_table(PARTS_HEADER, (parts_line(measure_parts(block, t, device)) for t in counts))
    if args.launches:
        sweep_launches(block, counts, device, args.launches)
    if args.shared_in_grouped:
        print("\nthe whole MoE block (router, experts, shared expert, combine), graph replays:")
        print_table(BLOCK_HEADER, (block_line(measure_block(block, t, device)) for t in counts))
    return 0


BLOCK_HEADER = f"{'T':>6} | {'shared separate ms':>18} | {'shared in grouped ms':>20} | {'ratio':>6} | {'rel diff':>8}"


def block_line(r: dict) -> str:
    return (f"{r['tokens']:>6} | {r['separate_ms']:18.3f} | {r['grouped_ms']:20.3f} | "
            f"{r['grouped_ms'] / r['separate_ms']:6.3f} | {r['rel_diff']:8.1e}")


@torch.inference_mode()
def measure_block(block: SparseMoE, tokens: int, device: str) -> dict:
    """The MoE block's forward with its shared expert as separate dense FP8 GEMMs
    (BATCHINFER_MOE_SHARED_IN_GROUPED=0) against the same expert as one more expert of the grouped
    kernel (=all), side by side."""
    from batchinfer.jobs.run.environ import environ_set
    from batchinfer.kernels import ops
    from batchinfer.models.layers import mlp
    H = block.experts_down.shape[1]
    x = torch.randn(tokens, H, device=device, generator=torch.Generator(device=device).manual_seed(tokens)).bfloat16()
    kernel = ops.implementation("moe_fp8", True)
    original, mlp._grouped_fp8_op = mlp._grouped_fp8_op, (lambda _: kernel)  # the kernel on the CPU too
    try:
        with environ_set({"BATCHINFER_MOE_SHARED_IN_GROUPED": "0"}):  # whatever the default step limit
            assert block._shared_in_grouped(x) is None
            separate = block(x).float()
            separate_ms = graph_time_ms(lambda: block(x), device)
        with environ_set({"BATCHINFER_MOE_SHARED_IN_GROUPED": "all"}):
            assert block._shared_in_grouped(x) is not None, "the shared expert cannot ride in the grouped kernel"
            grouped = block(x).float()
            grouped_ms = graph_time_ms(lambda: block(x), device)
    finally:
        mlp._grouped_fp8_op = original
    return {"tokens": tokens, "separate_ms": separate_ms, "grouped_ms": grouped_ms,
            "rel_diff": ((grouped - separate).norm() / separate.norm()).item()}


class _Skipped:
    """A Triton kernel whose launches do nothing (the part left out of a timed path)."""
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@torch.inference_mode()
def measure_parts(block: SparseMoE, tokens: int, device: str) -> dict:
    """The FP8 path (`SparseMoE._run_experts`) timed whole and with each part left out: the
    layout (`ops.moe_align`) and the activation quantization (each made once beforehand), the
    gate|up kernel, the down kernel (a kernel left out leaves garbage downstream, which costs the
    same). A part's time is the whole path's less the path without it; the
    GEMMs' floors are their own weights and scales of the experts hit, read once, at copy
    bandwidth. Graph replays, L2 flushed between them."""
    from unittest import mock

    from batchinfer.kernels import ops
    from batchinfer.kernels.moe_fp8 import grouped_gemm
    from batchinfer.models.layers import mlp
    H = block.experts_down.shape[1]
    x = torch.randn(tokens, H, device=device, generator=torch.Generator(device=device).manual_seed(tokens)).bfloat16()
    experts, _ = block.route(x)
    ends = ops.moe_align(experts, block.num_experts).ends.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [E] rows an expert
    hit = int((counts > 0).sum())
    quantized = grouped_gemm.quantize_act(x)
    launch = grouped_gemm.default_launch(experts.numel(), block.num_experts)
    layout = ops.moe_align(experts, block.num_experts, launch.gate_up.block_m, launch.down.block_m)
    skipped = {
        "layout": [mock.patch.object(ops, "moe_align", lambda *args: layout)],
        "quantize": [mock.patch.object(grouped_gemm, "quantize_act", lambda _x: quantized)],
        "gate_up": [mock.patch.object(grouped_gemm, name, _Skipped())
                    for name in ("_gate_up_kernel", "gate_up_swapped_kernel")],
        "down": [mock.patch.object(grouped_gemm, name, _Skipped()) for name in ("_down_kernel", "down_swapped_kernel")],
    }
    kernel = ops.implementation("moe_fp8", True)
    times = {}
    with mock.patch.object(mlp, "_grouped_fp8_op", lambda _: kernel):  # the kernel on the CPU too
        times["whole"] = graph_time_ms(lambda: block._run_experts(x, experts), device)
        for part, patches in skipped.items():
            for patch in patches:
                patch.start()
            try:
                times[part] = times["whole"] - graph_time_ms(lambda: block._run_experts(x, experts), device)
            finally:
                for patch in patches:
                    patch.stop()
    floors = {name: 1e3 * hit * (w.weight[0].numel() + 4 * w.scale_inv[0].numel()) / COPY_BANDWIDTH
              for name, w in (("gate_up", block.experts_gate_up), ("down", block.experts_down))}
    return {"tokens": tokens, "experts_hit": hit, **{f"{k}_ms": v for k, v in times.items()},
            **{f"{k}_floor_ms": v for k, v in floors.items()}}


PARTS_HEADER = (f"{'T':>5} {'E hit':>5} | {'whole ms':>8} | {'layout':>6} | {'quant':>6} | "
                f"{'gate|up ms (x floor)':>20} | {'down ms (x floor)':>18} | {'rest':>6}")


def parts_line(r: dict) -> str:
    rest = r["whole_ms"] - sum(r[f"{k}_ms"] for k in ("layout", "quantize", "gate_up", "down"))
    return (f"{r['tokens']:>5} {r['experts_hit']:>5} | {r['whole_ms']:8.3f} | {r['layout_ms']:6.3f} | "
            f"{r['quantize_ms']:6.3f} | {r['gate_up_ms']:8.3f} ({r['gate_up_ms'] / r['gate_up_floor_ms']:5.2f}x)     | "
            f"{r['down_ms']:8.3f} ({r['down_ms'] / r['down_floor_ms']:5.2f}x)   | {rest:6.3f}")


def expert_flops(block: SparseMoE, tokens: int) -> float:
    """The routed experts' matrix FLOPs for `tokens`: gate|up and down over top-k rows each."""
    hidden, intermediate = block.experts_down.shape[1], block.experts_down.shape[2]
    return 2.0 * tokens * block.top_k * 3 * hidden * intermediate


def sweep_launches(block: SparseMoE, counts: list[int], device: str, launches: str) -> None:
    """The FP8 path's time per fixed launch (default_launch replaced), per token count."""
    from batchinfer.kernels.moe_fp8 import grouped_gemm
    from batchinfer.kernels.moe_fp8.grouped_gemm import parse_launch
    default = grouped_gemm.default_launch
    print("\nlaunch (gate|up block_m:warps:stages / down ...:block_n) | "
          + " | ".join(f"T={t} fp8 ms (x floor)" for t in counts))
    try:
        for text in launches.split(","):
            fixed = parse_launch(text)
            grouped_gemm.default_launch = lambda num_rows, num_experts, fixed=fixed: fixed
            cells = []
            for tokens in counts:
                r = measure(block, tokens, device)
                # each launch's rows against the dequantized path: a launch that computes wrong rows shows
                cells.append(f"{r['fp8_ms']:.3f} ({r['fp8_ms'] / r['floor_ms']:.2f}x, "
                             f"{expert_flops(block, tokens) / r['fp8_ms'] / 1e9:.0f} TFLOP/s, err {r['rel_err']:.1e})")
            print(f"{text} | " + " | ".join(cells), flush=True)
    finally:
        grouped_gemm.default_launch = default

if __name__ == "__main__":
    sys.exit(main())
