"""The FP8 block-scaled GEMM (kernels/fp8_gemm) against bf16 cuBLAS at the qwen3.5-27b projection shapes:

    python -m benchmarks.bench_fp8_gemm            # H200: M = 256 (decode) and 8192 (prefill)
    python -m benchmarks.bench_fp8_gemm --quick    # CPU smoke run (interpreter, tiny shapes)
    python -m benchmarks.bench_fp8_gemm --sm90     # no GPU: compile both kernels for sm_90a, resources
    python -m benchmarks.bench_fp8_gemm --decode 8,32,48,64 --swapped 128:4:3,64:4:3
                                                   # decode rows: the swapped GEMM against cuBLAS
    python -m benchmarks.bench_fp8_gemm --sm90 --swapped 128:4:3,64:4:3   # their sm_90a resources

Per shape: bf16 `torch.matmul` TFLOP/s, ours end to end (activation quant + GEMM) with the
default launch and with the best of a small launch sweep, the GEMM alone, the ratio over bf16,
`torch._scaled_mm` with block scales where this torch accepts them, the op as the model
calls it (`fp8_gemm`: cuBLAS's block-scaled GEMM where it runs, activation quant included), and the max error of ours
against the fp32 dequantize-then-matmul reference (relative to the reference's max). Table last.

`--decode ROWS`: at each decode row count and shape, the GEMM alone on quantized activations as
CUDA-graph replays (decode runs them so): cuBLAS's block-scaled GEMM against the swapped GEMM
(`kernels/fp8_gemm/swapped.py`) at each `--swapped` launch (BLOCK_N:WARPS:STAGES[:SPLITS]), each
as TB/s of its weight bytes and against the copy rate measured in the same run.
"""
from __future__ import annotations

import argparse

import torch

from batchinfer.kernels.fp8_gemm import block_quantize, fp8_gemm_reference
from batchinfer.kernels.fp8_gemm.swapped import SwappedLaunch, fp8_block_matmul_swapped, row_tile
from batchinfer.kernels.fp8_gemm.triton_fp8 import Fp8GemmLaunch, default_launch, fp8_block_matmul, quantize_act
from benchmarks.bench_utils import print_table as print_rows
from benchmarks.bench_utils import time_ms

HIDDEN = 5120
# (name, N, K) of the 27B's projections as the model runs them (fused rows).
SHAPES_27B = [
    ("attn qkv_proj", 2 * 24 * 256 + 2 * 4 * 256, HIDDEN),
    ("attn o_proj", HIDDEN, 24 * 256),
    ("gdn in_proj qkvz", 2 * 16 * 128 + 2 * 48 * 128, HIDDEN),
    ("gdn out_proj", HIDDEN, 48 * 128),
    ("mlp gate_up", 2 * 17408, HIDDEN),
    ("mlp down", HIDDEN, 17408),
]
SWEEP = [Fp8GemmLaunch(bm, bn, w, s) for bm, bn, w, s in [
    (64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3),
    (128, 256, 8, 3), (128, 64, 4, 4), (32, 128, 4, 4)]]


def scaled_mm_blockwise(xq, xs, w_q, w_s):
    """torch._scaled_mm with 1x128 activation / 128x128 weight scales, or the reason it refuses."""
    try:
        fn = lambda: torch._scaled_mm(xq, w_q.t(), scale_a=xs.t().contiguous().t(), scale_b=w_s.t(),
                                      out_dtype=torch.bfloat16)
        fn()
        return fn, ""
    except Exception as err:  # the op's constraints vary by torch version and device
        return None, str(err).splitlines()[0][:60]


def bench_shape(name: str, M: int, N: int, K: int, device: str, sweep: list[Fp8GemmLaunch]) -> dict:
    g = torch.Generator(device=device).manual_seed(M + N + K)
    x = torch.randn(M, K, device=device, generator=g).bfloat16()
    w = torch.randn(N, K, device=device, generator=g) * K ** -0.5
    w_bf16 = w.bfloat16()
    w_q, w_s = block_quantize(w)
    del w
    flop = 2 * M * N * K
    row = {"shape": name, "M": M, "N": N, "K": K}
    row["bf16_tflops"] = flop / time_ms(lambda: torch.matmul(x, w_bf16.t()), device) / 1e9
    xq, xs = quantize_act(x)
    ref = fp8_gemm_reference(x, w_q, w_s, torch.float32)
    out = fp8_block_matmul(xq, xs, w_q, w_s, torch.float32)
    row["rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
    del ref, out
    best_ms, best = float("inf"), None
    for launch in [default_launch(M, N, K)] + sweep:
        ms = time_ms(lambda: fp8_block_matmul(xq, xs, w_q, w_s, launch=launch), device)
        if launch == default_launch(M, N, K):
            row["gemm_default_tflops"] = flop / ms / 1e9
        if ms < best_ms:
            best_ms, best = ms, launch
    row["gemm_best_tflops"] = flop / best_ms / 1e9
    row["best_launch"] = f"{best.block_m}x{best.block_n} w{best.num_warps} s{best.num_stages}"
    end_to_end = lambda: fp8_block_matmul(*quantize_act(x), w_q, w_s, launch=best)
    row["fp8_tflops"] = flop / time_ms(end_to_end, device) / 1e9
    row["ratio"] = row["fp8_tflops"] / row["bf16_tflops"]
    fn, why = scaled_mm_blockwise(xq, xs, w_q, w_s) if device == "cuda" else (None, "cpu")
    row["scaled_mm_tflops"] = flop / time_ms(fn, device) / 1e9 if fn else float("nan")
    row["scaled_mm_note"] = why
    if device == "cuda":  # the op as the model calls it: cuBLAS block-scaled where it runs (quant included)
        from batchinfer.kernels.fp8_gemm import cublas_fp8, fp8_gemm
        row["op_tflops"] = flop / time_ms(lambda: fp8_gemm(x, w_q, w_s), device) / 1e9
        row["op_path"] = "cublas" if cublas_fp8.available(x.device) and cublas_fp8.shapes_supported(K, w_s) else "triton"
    else:
        row["op_tflops"], row["op_path"] = float("nan"), "reference"
    return row


def _compile_sm90(fn, types: dict, constexprs: dict, options: dict, not_divisible: tuple = ()):
    """Offline sm_90a compile (Triton's own ptxas, no GPU) of `fn` with pointer `types` (other
    arguments i32, divisible by 16 unless named in `not_divisible`, as the launcher specialises
    contiguous tensors' sizes). Returns the compiled kernel (`.asm["ptx"]`, `.metadata`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    divisible = [i for i, n in enumerate(names) if n not in constexprs and n not in not_divisible]
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_sm90(launch: Fp8GemmLaunch | None, k_tiles: int = HIDDEN // 128):
    """The Triton GEMM at `launch` compiled for sm_90a, or the activation-quant kernel when None."""
    from batchinfer.kernels.fp8_gemm import triton_fp8 as kernels
    if launch is None:
        return _compile_sm90(kernels._quant_act_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                             dict(BLOCK_G=8, GROUP_SIZE=128), {"num_warps": 4})
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32"}
    constexprs = dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=128, GROUP_M=launch.group_m,
                      SCALE_BLOCK_N=128, K_TILES=k_tiles)
    return _compile_sm90(kernels._fp8_gemm_kernel, types, constexprs,
                         {"num_warps": launch.num_warps, "num_stages": launch.num_stages})


def compile_swapped_sm90(launch: SwappedLaunch, M: int, K: int = HIDDEN, splits: int = 1):
    """The swapped GEMM at `launch` for M rows compiled for sm_90a."""
    from batchinfer.kernels.fp8_gemm import swapped
    types = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "y_ptr": "*bf16",
             "part_ptr": "*fp32", "count_ptr": "*i32"}
    k_tiles = K // 128
    constexprs = dict(BLOCK_N=launch.block_n, BLOCK_M=row_tile(M), BLOCK_K=128, K_TILES=k_tiles, SPLITS=splits,
                      TILES_PER_SPLIT=k_tiles // splits, EVEN_K=True)
    return _compile_sm90(swapped._fp8_gemm_swapped_kernel, types, constexprs,
                         {"num_warps": launch.num_warps, "num_stages": launch.num_stages},
                         not_divisible=("M", "stride_xsg"))


def parse_swapped(text: str) -> list[SwappedLaunch]:
    """'128:4:3,64:4:3:2' → launches (BLOCK_N:WARPS:STAGES[:SPLITS])."""
    launches = []
    for item in filter(None, text.split(",")):
        parts = [int(p) for p in item.split(":")]
        launches.append(SwappedLaunch(*parts[:3], splits=parts[3] if len(parts) > 3 else None))
    return launches


def print_sm90(swapped_launches: list[SwappedLaunch] | None = None) -> None:
    import re

    from benchmarks.sm90_compile import ptxas_resources
    if swapped_launches:
        for launch in swapped_launches:
            for M, splits in ((8, 1), (32, 4), (64, 1)):
                kernel = compile_swapped_sm90(launch, M, splits=splits)
                registers, spills = ptxas_resources(kernel.asm["ptx"])
                wgmma = len(re.findall(r"wgmma\.mma_async[^\n]*e4m3", kernel.asm["ptx"]))
                print(f"swapped {launch.block_n}:{launch.num_warps}:{launch.num_stages} M {M:3d} splits {splits}  "
                      f"registers {registers:4d}  spill {spills:5d} B  smem {kernel.metadata.shared:7d} B  "
                      f"e4m3 wgmma {wgmma}")
        return
    for launch in [None] + SWEEP:
        kernel = compile_sm90(launch)
        ptx = kernel.asm["ptx"]
        registers, spills = ptxas_resources(ptx)
        wgmma = len(re.findall(r"wgmma\.mma_async[^\n]*e4m3", ptx))
        what = "quantize_act" if launch is None else (
            f"gemm {launch.block_m}x{launch.block_n} w{launch.num_warps} s{launch.num_stages}")
        print(f"{what:28} registers {registers:4d}  spill {spills:5d} B  smem {kernel.metadata.shared:7d} B  "
              f"e4m3 wgmma {wgmma}")


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':18} {'M':>5} {'N':>6} {'K':>6} {'bf16':>7} {'fp8':>7} {'ratio':>6} {'gemm':>7} "
          f"{'gemm@def':>8} {'best launch':>16} {'_scaled_mm':>10} {'op':>7} {'op path':>8} {'op/bf16':>8} {'rel err':>8}  (TFLOP/s)")
    for r in rows:
        print(f"{r['shape']:18} {r['M']:5d} {r['N']:6d} {r['K']:6d} {r['bf16_tflops']:7.1f} {r['fp8_tflops']:7.1f} "
              f"{r['ratio']:6.2f} {r['gemm_best_tflops']:7.1f} {r['gemm_default_tflops']:8.1f} {r['best_launch']:>16} "
              f"{r['scaled_mm_tflops']:10.1f} {r['op_tflops']:7.1f} {r['op_path']:>8} {r['op_tflops'] / r['bf16_tflops']:8.2f} "
              f"{r['rel_err']:8.1e}")
    notes = {r["scaled_mm_note"] for r in rows if r["scaled_mm_note"]}
    for note in notes:
        print(f"torch._scaled_mm (block scales): {note}")


def graph_ms(fn, device: str) -> float:
    """ms of fn as a CUDA-graph replay, as decode runs it (eager time elsewhere)."""
    if device != "cuda":
        return time_ms(fn, device)
    from benchmarks.decode_floor import graphed
    return time_ms(graphed(fn), device)


def bench_decode(rows: list[int], launches: list[SwappedLaunch], device: str, shapes=SHAPES_27B) -> list[str]:
    """Per (rows, shape): cuBLAS and each swapped launch as TB/s of the weight's bytes (graph
    replays of the GEMM alone, activations quantized outside), and each one's error against the
    fp32 reference (relative to its max)."""
    from batchinfer.kernels.fp8_gemm import cublas_fp8
    from benchmarks.decode_floor import copy_bandwidth
    copy = copy_bandwidth(torch.device(device)) / 1e12 if device == "cuda" else float("nan")
    lines = []
    for M in rows:
        for name, N, K in shapes:
            g = torch.Generator(device=device).manual_seed(M + N + K)
            x = torch.randn(M, K, device=device, generator=g).bfloat16()
            w_q, w_s = block_quantize(torch.randn(N, K, device=device, generator=g) * K ** -0.5)
            ref = fp8_gemm_reference(x, w_q, w_s, torch.float32)
            weight_bytes = w_q.numel() + 4 * w_s.numel()
            cells = []
            if device == "cuda" and cublas_fp8.available(x.device) and cublas_fp8.shapes_supported(K, w_s):
                pq, ps = quantize_act(x, rows=cublas_fp8.padded_rows(M), scales_transposed=True)
                ms = graph_ms(lambda: cublas_fp8.block_scaled_mm(pq, ps.t(), w_q, w_s, torch.bfloat16), device)
                cells.append(f"cublas {weight_bytes / ms / 1e9:5.2f}")
            else:
                cells.append("cublas   -  ")
            xq, xs = quantize_act(x)
            for launch in launches:
                what = f"{launch.block_n}:{launch.num_warps}:{launch.num_stages}:{launch.splits or 'a'}"
                try:
                    out = torch.full((M, N), float("nan"), device=device)
                    fp8_block_matmul_swapped(xq, xs, w_q, w_s, torch.float32, launch=launch, out=out)
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    ms = graph_ms(lambda: fp8_block_matmul_swapped(xq, xs, w_q, w_s, torch.bfloat16, launch=launch),
                                  device)
                    cells.append(f"{what} {weight_bytes / ms / 1e9:5.2f} (err {err:.0e})")
                except Exception as error:  # e.g. a launch whose stages do not fit shared memory
                    cells.append(f"{what} {type(error).__name__}")
            lines.append(f"{M:5d} {name:18} {N:6d} {K:6d}  " + "  ".join(cells))
            print(lines[-1], flush=True)  # as it goes: a call cut short keeps its rows
    header = (f"{'M':>5} {'shape':18} {'N':>6} {'K':>6}  TB/s of the weight's bytes, graph replays "
              f"(copy {copy:.2f} TB/s read + write)")
    print_rows(header, lines)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, no sweep")
    parser.add_argument("--sm90", action="store_true", help="no GPU: compile for sm_90a and print resources")
    parser.add_argument("--no-sweep", action="store_true", help="only the default Triton launch")
    parser.add_argument("--decode", default="", help="decode row counts: the swapped GEMM against cuBLAS")
    parser.add_argument("--swapped", default=None,
                        help="swapped launches BLOCK_N:WARPS:STAGES[:SPLITS] (with --decode: default 128:4:3,64:4:3)")
    args = parser.parse_args()
    if args.sm90:
        return print_sm90(parse_swapped(args.swapped) if args.swapped else None)
    if args.decode:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shapes = SHAPES_27B if device == "cuda" else [("tiny", 256, 512)]
        rows = [int(m) for m in args.decode.split(",")]
        bench_decode(rows, parse_swapped(args.swapped or "128:4:3,64:4:3"), device, shapes)
        return
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        cases = [("tiny", 16, 256, 384)]
        sweep = []
    else:
        cases = [(name, M, N, K) for M in (256, 8192) for name, N, K in SHAPES_27B]
        sweep = [] if args.no_sweep else SWEEP
    rows = []
    for name, M, N, K in cases:
        rows.append(bench_shape(name, M, N, K, device, sweep))
        torch.cuda.empty_cache() if device == "cuda" else None
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print_table(rows)


if __name__ == "__main__":
    main()
