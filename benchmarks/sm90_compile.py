"""Offline sm_90 compile check of the GDN prefill kernels: registers, spills and shared memory per
launch config, with no GPU (Triton compiles to PTX for a given target; the ptxas bundled with
Triton assembles it for sm_90a and reports the resources).

    python -m benchmarks.sm90_compile wy --block-v 64    # num_warps 2/4/8 (the WY kernel has no block_v)
    python -m benchmarks.sm90_compile output --warps 4 --block-v 64 --stages 2
    WY_KEY_STEP=16 python -m benchmarks.sm90_compile wy --warps 4 --maxnreg 168
    STATE_KEY_PARTS=2 python -m benchmarks.sm90_compile state_pass --warps 4 8 --block-v 32 64 --stages 2 3

Shapes are the model's (H_k 16, H_v 48, d_k = d_v = 128, bf16 inputs, fp32 G / state pool).
Integer arguments are specialised as Triton's launcher would at those values (divisible by 16),
so the code is the one the GPU runs. "spill" is ptxas's spill stores + loads in bytes; "mma" counts
tensor-core instructions in the PTX text (mma.sync / wgmma; static, loops not unrolled), a rough
check on the dot count. Each config compiles in ~15 s on one CPU core.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from batchinfer.kernels import gdn_prefill as K
from batchinfer.kernels.gdn_prefill import CHUNK, SUB, WY_KEY_STEP

H_K, H_V, D_K, D_V = 16, 48, 128, 128
T = 32768
KEY_STEP = int(os.environ.get("WY_KEY_STEP", WY_KEY_STEP))  # the WY kernel's d_k step, to try others
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
SM90 = GPUTarget("cuda", 90, 32)

# Runtime integer arguments at model values (contiguous inputs); the launcher specialises each
# int divisible by 16, and so do we.
INT_VALUES = dict(
    T=T, H_V=H_V, H_K=H_K, D_K=D_K, D_V=D_V,
    stride_qt=H_K * D_K, stride_qh=D_K, stride_kt=H_K * D_K, stride_kh=D_K,
    stride_vt=H_V * D_V, stride_vh=D_V, stride_at=H_V, stride_bt=H_V,
    stride_ot=H_V * D_V, stride_oh=D_V,
    stride_s0=H_V * D_K * D_V, stride_s1=D_K * D_V, stride_s2=D_V,
)
# The chunk range of a piece of the table: launched with do_not_specialize (no divisibility).
UNSPECIALISED_INTS = ("chunk_lo", "chunk_hi")
POINTER_TYPES = {
    "G_ptr": "*fp32", "k_inv_norm_ptr": "*fp32", "A_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "state_ptr": "*fp32",
    "chunk_start_ptr": "*i32", "chunk_end_ptr": "*i32", "cu_ptr": "*i32", "seq_offsets_ptr": "*i32",
    "slots_ptr": "*i64",
}  # every other pointer: bf16


@dataclass(frozen=True)
class KernelSpec:
    fn: object
    constexprs: Callable[[int], dict]  # block_v -> the kernel's constexpr arguments


def _common(block_v: int) -> dict:
    return dict(GROUP=H_V // H_K, C=CHUNK, BLOCK_K=D_K, BLOCK_V=block_v, DOT_DTYPE=tl.bfloat16)


KERNELS = {
    "wy": KernelSpec(K.chunk_wy_kernel, lambda bv: dict(  # no d_v block, no 16-bit operand cast
        {n: v for n, v in _common(bv).items() if n not in ("BLOCK_V", "DOT_DTYPE")}, SUB=SUB, K_STEP=KEY_STEP,
        PRECISION="tf32")),
    "state_pass": KernelSpec(K.state_pass_kernel, lambda bv: dict(
        _common(bv), D_K=D_K, D_V=D_V, SUB=SUB, LOOP_AS_WHILE=False,
        KEY_PARTS=int(os.environ.get("STATE_KEY_PARTS", 1)))),
    "output": KernelSpec(K.chunk_output_kernel, _common),
}


def compile_sm90(spec: KernelSpec, block_v: int, num_warps: int, num_stages: int, maxnreg: int | None = None):
    names = spec.fn.arg_names
    constexprs = spec.constexprs(block_v)
    signature, divisible = {}, []
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*bf16")
            divisible.append(index)
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in UNSPECIALISED_INTS and INT_VALUES[name] % 16 == 0:
                divisible.append(index)
    source = ASTSource(spec.fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:  # the register cap a launch can pass as `maxnreg=`
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=SM90, options=options)


def ptxas_resources(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill bytes stored + loaded) from `ptxas -v` for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        report = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    registers = int(re.findall(r"Used (\d+) registers", report)[0])
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=sorted(KERNELS))
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--block-v", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--stages", type=int, nargs="+", default=[1])
    parser.add_argument("--maxnreg", type=int, default=None, help="register cap per thread (launch kwarg maxnreg)")
    args = parser.parse_args()
    spec = KERNELS[args.kernel]
    print(f"{args.kernel} ({spec.fn.__name__}) for sm_90a, H_k {H_K} H_v {H_V} d {D_K} bf16")
    print(f"{'block_v':>8}{'warps':>6}{'stages':>7}{'regs':>6}{'spill B':>9}{'smem B':>8}{'mma':>6}")
    for block_v in args.block_v:
        for warps in args.warps:
            for stages in args.stages:
                compiled = compile_sm90(spec, block_v, warps, stages, args.maxnreg)
                ptx = compiled.asm["ptx"]
                registers, spills = ptxas_resources(ptx)
                mma = len(re.findall(r"^\s*(?:mma\.sync|wgmma\.mma_async)", ptx, flags=re.M))
                shared = compiled.metadata.shared
                print(f"{block_v:>8}{warps:>6}{stages:>7}{registers:>6}{spills:>9}{shared:>8}{mma:>6}")


if __name__ == "__main__":
    main()
