"""The d_k products of the ReplaySSM kernels as mma's (the step's dots and the fold's), with the
interpreter's 16-bit workaround."""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton 3.6's interpreter (the CPU tests) gets 16-bit tl.dot wrong; there the operands are
# widened to fp32, which computes the same products exactly (16-bit products fit in fp32).
WIDEN_DOTS = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _mma(a, b, acc):
    """acc + a @ b, fp32 accumulation: 16-bit operands on tensor cores, fp32 ones in true fp32."""
    if WIDEN_DOTS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _mma_fp32_operand(a, b, acc):
    """acc + a @ b where a or b is fp32 and the other may be 16-bit.

    Against a 16-bit operand the fp32 one goes in as its high and low parts in that dtype (two
    mma's): ~16 mantissa bits instead of 8, products exact, sums in fp32.
    """
    if a.dtype == b.dtype:
        acc = _mma(a, b, acc)
    elif a.dtype == tl.float32:
        high = a.to(b.dtype)
        acc = _mma((a - high.to(tl.float32)).to(b.dtype), b, _mma(high, b, acc))
    else:
        high = b.to(a.dtype)
        acc = _mma(a, (b - high.to(tl.float32)).to(a.dtype), _mma(a, high, acc))
    return acc
