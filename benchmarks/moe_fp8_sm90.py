"""Offline sm_90a compile of the grouped FP8 expert kernels (kernels/moe_fp8): registers, spills,
shared memory and tensor-core instructions per row tile, with no GPU (`python -m
benchmarks.bench_moe_fp8 --sm90`). Imported without Triton's interpreter, which cannot compile.
"""
from __future__ import annotations

from batchinfer.kernels.fp8_gemm.reference import GROUP


def compile_sm90(kernel: str, block_m: int, hidden: int = 2048, intermediate: int = 512,
                 launch=None):
    """Offline sm_90a compile (Triton's own ptxas, no GPU) of `gate_up` or `down` at the default
    launch for `block_m` (or at `launch`, a `MoeFp8Launch`); integer arguments specialised as the
    launcher would (multiples of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from batchinfer.kernels.moe_fp8 import grouped_gemm as K
    from batchinfer.kernels.moe_fp8 import swapped as S
    from batchinfer.kernels.moe_fp8 import w8a16 as W
    if launch is None:
        launch = next(K.default_launch(rows, 256) for rows in (256 * 8, 1024 * 8, 2048 * 8, 8192 * 8)
                      if K.default_launch(rows, 256).gate_up.block_m == block_m)
    fp8, fp32, i32 = "*fp8e4nv", "*fp32", "*i32"
    up = kernel == "gate_up"
    kernel_launch = launch.gate_up if up else launch.down
    constexprs = dict(BLOCK_M=kernel_launch.block_m, BLOCK_K=GROUP, COLUMNS_FASTEST=True)
    if up:
        constexprs.update(K_TILES=hidden // GROUP, N_BLOCKS=intermediate // GROUP)
    else:
        constexprs.update(BLOCK_N=launch.block_n_down, K_TILES=intermediate // GROUP,
                          N_BLOCKS=hidden // launch.block_n_down)
    if launch.w8a16:  # the W8A16 pair: 16-bit activations (fp16 with fp16 dots), no activation scales
        act = "*fp16" if launch.fp16_dots else "*bf16"
        fn = W.gate_up_w8a16_kernel if up else W.down_w8a16_kernel
        types = dict(x_ptr=act, token_ptr=i32, h_ptr=act) if up else dict(h_ptr=act, y_ptr="*bf16")
        constexprs.update(PRECISION="tf32", FP16_DOTS=launch.fp16_dots)
    else:
        fn = (S.gate_up_swapped_kernel if up else S.down_swapped_kernel) if launch.swap_ab else \
            (K._gate_up_kernel if up else K._down_kernel)
        types = dict(xq_ptr=fp8, xs_ptr=fp32, token_ptr=i32, hq_ptr=fp8, hs_ptr=fp32) if up else \
            dict(hq_ptr=fp8, hs_ptr=fp32, y_ptr="*bf16")
    types.update(w_ptr=fp8, ws_ptr=fp32, shared_w_ptr=fp8, shared_ws_ptr=fp32)
    types.update(tile_expert_ptr=i32, tile_start_ptr=i32, tile_end_ptr=i32)
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    divisible = [i for i, n in enumerate(names) if n not in constexprs and n not in fn.do_not_specialize]
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": kernel_launch.num_warps, "num_stages": kernel_launch.num_stages})


def print_sm90(launches: list | None = None) -> None:
    """Resources of both kernels at the default launches' row tiles, or at each of `launches`."""
    import re

    from benchmarks.sm90_compile import ptxas_resources
    cases = [(kernel, block_m, None) for kernel in ("gate_up", "down") for block_m in (16, 32, 64)]
    if launches:
        cases = [(kernel, 0, launch) for launch in launches for kernel in ("gate_up", "down")]
    for kernel, block_m, launch in cases:
        compiled = compile_sm90(kernel, block_m, launch=launch)
        ptx = compiled.asm["ptx"]
        registers, spills = ptxas_resources(ptx)
        # Below 64 rows Triton runs the dots as f16 mma.sync on e4m3 values converted exactly.
        mma = len(re.findall(r"(?:wgmma\.mma_async|mma\.sync)\S*", ptx))
        kind = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync"
        conversions = len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx))  # e4m3 pairs widened for f16 dots
        # how many tensor-core groups a wait leaves in flight (0: each dot waited for at once)
        pending = max((int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)), default=0)
        mode = (" w8a16" + (" fp16 dots" if launch.fp16_dots else "")) if launch is not None and launch.w8a16 else ""
        mode += " swap" if launch is not None and launch.swap_ab else ""
        shown = block_m if launch is None else f"{getattr(launch, kernel)}{mode}"
        print(f"{kernel:8} {shown}  registers {registers:4d}  spill {spills:5d} B  "
              f"smem {compiled.metadata.shared:7d} B  {kind} {mma}  in flight {pending}  e4m3 cvt {conversions}")
