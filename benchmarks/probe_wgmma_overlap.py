"""Probe (GPU, Hopper): does a block-scaled FP8 GEMM get faster when each K step's tensor-core
product stays in flight while the previous one is scaled and added?

    python -m benchmarks.probe_wgmma_overlap                 # correctness, then the timing table
    python -m benchmarks.probe_wgmma_overlap --sm90          # no GPU: compile for sm_90a, print waits

Why: our Triton FP8 kernels (the dense GEMM, the MoE experts) compute acc += dot(a, b) · scales,
and Triton waits for every dot before scaling it (`wgmma.wait_group 0`): the tensor cores idle
while a step is scaled, and the prefill expert GEMMs stay near 500 TFLOP/s where cuBLAS's
block-scaled GEMM reaches ~1,200 (docs/BENCHMARKS.md, "FP8 experts"). Triton 3.6 gives no way to
keep a scaled product in flight; Gluon (Triton's lower-level language, shipped with it) does:
here the dot of step k is issued before step k-1's product is waited for (`wait_group 1`) and
added at its scales. The same kernel with OVERLAP=False waits at once, so the two differ only in
that. Beside them: our Triton FP8 GEMM and cuBLAS's block-scaled `scaled_mm` on the same operands.

A dense GEMM, not the grouped one: if the overlap does not pay here it will not pay there.
"""
from __future__ import annotations

import argparse
import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_N = 128  # one weight scale block wide: a step's weight scale is one number
BLOCK_K = 128  # one activation scale group deep


@gluon.jit
def _load_step(a_desc, b_desc, a_smem, b_smem, bars, off_m, off_n, step, NUM_STAGES: gl.constexpr):
    """TMA loads of K step `step`'s A and B tiles into its ring slot, completing on its barrier."""
    slot = step % NUM_STAGES
    mbarrier.expect(bars.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [off_m, step * a_desc.block_type.shape[1]], bars.index(slot),
                                    a_smem.index(slot))
    tma.async_copy_global_to_shared(b_desc, [off_n, step * b_desc.block_type.shape[1]], bars.index(slot),
                                    b_smem.index(slot))


@gluon.jit
def block_scaled_gemm_kernel(a_desc, b_desc, as_ptr, bs_ptr, c_ptr, M, N, stride_asm, stride_bsn, stride_cm,
                             K_TILES: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                             OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    """c [M, N] = Σ_k (a_k · b_kᵀ) · as[m, k] · bs[n // 128, k]: a e4m3 [M, K], b e4m3 [N, K] (both
    K-major, through TMA descriptors of [BM, 128] / [128, 128] tiles), as fp32 [M, K/128], bs fp32
    [N/128, K/128]. NUM_STAGES ring slots of A and B, refilled NUM_STAGES - 1 steps ahead."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BN)
    # GROUP_M row tiles walk the same weight columns while those sit in L2.
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BN

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 32])
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(NUM_STAGES - 1):
        if i < K_TILES:
            _load_step(a_desc, b_desc, a_smem, b_smem, bars, off_m, off_n, i, NUM_STAGES)

    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    row_ok = rows < M
    as_ptrs = as_ptr + rows * stride_asm
    bs_row = bs_ptr + pid_n * stride_bsn
    acc = gl.zeros([BLOCK_M, BN], gl.float32, layout=mma)

    # Step 0 opens the chain: its product is `prev` until the next step's dot is issued.
    mbarrier.wait(bars.index(0), 0)
    prev = warpgroup_mma(a_smem.index(0), b_smem.index(0).permute((1, 0)), acc, use_acc=False, is_async=True)
    prev_scale = gl.load(as_ptrs, mask=row_ok, other=0.0) * gl.load(bs_row)
    if not OVERLAP:
        prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    if NUM_STAGES - 1 < K_TILES:
        _load_step(a_desc, b_desc, a_smem, b_smem, bars, off_m, off_n, NUM_STAGES - 1, NUM_STAGES)
    for step in range(1, K_TILES):
        slot = step % NUM_STAGES
        mbarrier.wait(bars.index(slot), (step // NUM_STAGES) & 1)
        cur = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), acc, use_acc=False,
                            is_async=True)
        scale = gl.load(as_ptrs + step, mask=row_ok, other=0.0) * gl.load(bs_row + step)  # [BM]
        if OVERLAP:  # this step's dot stays in flight while the previous one is added
            prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
            acc += prev * prev_scale[:, None]
        else:
            acc += prev * prev_scale[:, None]
            cur = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
        if step + NUM_STAGES - 1 < K_TILES:  # the slot of step - 1, whose dot has retired
            _load_step(a_desc, b_desc, a_smem, b_smem, bars, off_m, off_n, step + NUM_STAGES - 1, NUM_STAGES)
        prev = cur
        prev_scale = scale
    prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    acc += prev * prev_scale[:, None]
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(bars.index(i))
    gl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols < N)[None, :])


def descriptors(xq: torch.Tensor, weight: torch.Tensor, block_m: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(xq, [block_m, BLOCK_K], a_layout),
            TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K], b_layout))


def block_scaled_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                      overlap: bool = True, num_stages: int = 4, num_warps: int = 8, group_m: int = 8,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """xq e4m3 [M, K], x_scale fp32 [M, K/128], weight e4m3 [N, K], scale_inv fp32 [N/128, K/128]
    → bf16 [M, N]. K a multiple of 128 (TMA pads nothing here)."""
    M, K = xq.shape
    N = weight.shape[0]
    assert K % BLOCK_K == 0 and weight.shape[1] == K and scale_inv.shape == (triton.cdiv(N, BLOCK_N), K // BLOCK_K)
    block_m = 16 * num_warps  # the wgmma layout puts num_warps × 16 rows on M
    out = torch.empty((M, N), dtype=torch.bfloat16, device=xq.device) if out is None else out
    a_desc, b_desc = descriptors(xq, weight, block_m)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, BLOCK_N),)
    block_scaled_gemm_kernel[grid](a_desc, b_desc, x_scale, scale_inv, out, M, N, x_scale.stride(0),
                                   scale_inv.stride(0), out.stride(0), K_TILES=K // BLOCK_K, NUM_STAGES=num_stages,
                                   GROUP_M=group_m, OVERLAP=overlap, num_warps=num_warps)
    return out


def compile_sm90(overlap: bool, num_stages: int = 4, num_warps: int = 8, K: int = 2048):
    """Offline sm_90a compile (no GPU): the descriptors' types from CPU tensors of the same dtype."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    block_m = 16 * num_warps
    a_desc, b_desc = descriptors(torch.empty((4096, K), dtype=torch.float8_e4m3fn),
                                 torch.empty((1024, K), dtype=torch.float8_e4m3fn), block_m)
    fn = block_scaled_gemm_kernel
    constexprs = dict(K_TILES=K // BLOCK_K, NUM_STAGES=num_stages, GROUP_M=8, OVERLAP=overlap, num_warps=num_warps)
    types = dict(a_desc=mangle_type(a_desc), b_desc=mangle_type(b_desc), as_ptr="*fp32", bs_ptr="*fp32", c_ptr="*bf16")
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = ("as_ptr", "bs_ptr", "c_ptr", "stride_asm", "stride_bsn", "stride_cm")
    source = GluonASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": 1})


def wgmma_waits(ptx: str) -> list[int]:
    """The in-flight counts of the kernel's wgmma waits (0: a dot waited for at once)."""
    return [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)]


def print_sm90() -> None:
    from benchmarks.sm90_compile import ptxas_resources
    for overlap in (True, False):
        compiled = compile_sm90(overlap)
        registers, spills = ptxas_resources(compiled.asm["ptx"])
        print(f"overlap={overlap!s:5}  waits {wgmma_waits(compiled.asm['ptx'])}  registers {registers}  "
              f"spill {spills} B  smem {compiled.metadata.shared} B")


SHAPES = [  # (name, M, N, K): the 27B's prefill projections at an 8k step; an expert-sized GEMM
    ("27B mlp gate_up", 8192, 34816, 5120),
    ("27B mlp down", 8192, 5120, 17408),
    ("27B attn qkv", 8192, 14336, 5120),
    ("35B-A3B expert gate|up, 1,024 rows", 1024, 1024, 2048),
    ("35B-A3B experts gate|up, stacked", 8192, 1024, 2048),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sm90", action="store_true", help="no GPU: compile for sm_90a and print the waits")
    parser.add_argument("--reps", type=int, default=5, help="do_bench repetitions (median taken)")
    args = parser.parse_args()
    if args.sm90:
        print_sm90()
        return
    from batchinfer.kernels.fp8_gemm import cublas_fp8
    from batchinfer.kernels.fp8_gemm.reference import block_dequantize, block_quantize
    from batchinfer.kernels.fp8_gemm.triton_fp8 import fp8_block_matmul, quantize_act
    torch.manual_seed(0)
    rows = []
    for name, M, N, K in SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        wq, ws = block_quantize(torch.randn(N, K, device="cuda") * 0.02)
        xq, xs = quantize_act(x)
        xs_t = quantize_act(x, scales_transposed=True)[1]
        reference = (xq.float() * xs.repeat_interleave(BLOCK_K, dim=1)) @ block_dequantize(wq, ws).t()
        arms = {
            "gluon, in flight": lambda out: block_scaled_gemm(xq, xs, wq, ws, overlap=True, out=out),
            "gluon, waited": lambda out: block_scaled_gemm(xq, xs, wq, ws, overlap=False, out=out),
            "triton (ours)": lambda out: fp8_block_matmul(xq, xs, wq, ws, out=out),
            "cuBLAS scaled_mm": lambda out: cublas_fp8.block_scaled_mm(xq, xs_t.t(), wq, ws, torch.bfloat16),
        }
        flops = 2.0 * M * N * K
        for arm, run in arms.items():
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            got = run(out).float()
            err = ((got - reference).abs().max() / reference.abs().max()).item()
            ms = sorted(triton.testing.do_bench(lambda: run(out), warmup=25, rep=100) for _ in range(args.reps))
            median = ms[len(ms) // 2]
            rows.append((name, arm, median, flops / median / 1e9, err))
            print(f"{name:38} {arm:18} {median:8.3f} ms  {flops / median / 1e9:7.1f} TFLOP/s  max err {err:.2e}",
                  flush=True)
    print("\n| shape | arm | ms | TFLOP/s | max err / max |ref| |\n|---|---|---|---|---|")
    for name, arm, median, tflops, err in rows:
        print(f"| {name} | {arm} | {median:.3f} | {tflops:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
