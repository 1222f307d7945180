"""Triton SwiGLU activation: `silu(gate) · up` over a fused `gate | up` projection row.

Unfused, torch runs silu and the product as two elementwise kernels with a [T, I] intermediate
between them (written, then read back): at decode the MLP activation is pure memory traffic,
so one pass that reads gate|up once and writes the product once moves 3 instead of 5 row-sized
tensors. The maths runs in fp32 and rounds once (torch's bf16 path rounds silu(gate) first).
Reference: kernels/ref/activation.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SiluMulLaunch:
    """One program per (row, block of `block` output columns)."""

    block: int = 1024
    num_warps: int = 4


DEFAULT_SILU_MUL_LAUNCH = SiluMulLaunch()


@triton.jit
def silu_mul_kernel(
    gate_up_ptr, out_ptr,
    stride_in, stride_out, I,
    BLOCK: tl.constexpr,
):
    # Rows on grid axis 0 (up to 2^31 programs): a prefill step's T can exceed axis 1's 65535.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate_ptrs = gate_up_ptr + row * stride_in + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, launch: SiluMulLaunch = DEFAULT_SILU_MUL_LAUNCH) -> torch.Tensor:
    """`silu(gate_up[..., :I]) · gate_up[..., I:]` -> [..., I] (contiguous), in gate_up.dtype.

    Rows may be strided (e.g. a column slice of a wider projection); columns need unit stride.
    """
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_mul needs an even last dim (gate | up), got {two_i}")
    intermediate = two_i // 2
    rows = gate_up.reshape(-1, two_i)  # [M, 2I], a view whenever the leading dims allow
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], intermediate, dtype=gate_up.dtype, device=gate_up.device)  # [M, I]
    if out.numel() > 0:
        grid = (rows.shape[0], triton.cdiv(intermediate, launch.block))
        silu_mul_kernel[grid](
            rows, out, rows.stride(0), out.stride(0), intermediate,
            BLOCK=launch.block, num_warps=launch.num_warps,
        )
    return out.view(*gate_up.shape[:-1], intermediate)
