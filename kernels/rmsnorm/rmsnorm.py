"""Triton RMSNorms: one row per program, the whole row in registers (N ≤ a few thousand).

`rms_norm` scales by `(1 + weight)` (residual-stream norm of the Qwen3.5 family);
`gated_rms_norm` scales by the plain weight and multiplies by `silu(z)` (GDN output norm);
`add_rms_norm` fuses the residual add before the former (one read of x and of the delta, one
write of the sum and of the normed row, instead of an add kernel and a norm kernel).
All compute in fp32 and return x.dtype; references: kernels/ref/norm.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    stride_x, stride_z_outer, stride_z_inner, z_inner, stride_out, N, eps,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    if GATED:
        # z row `row` = (row // z_inner, row % z_inner) of a [T, z_inner, N] view: the GDN gate is
        # a strided slice of the projection, read in place rather than copied to rows first.
        z_row = z_ptr + (row // z_inner) * stride_z_outer + (row % z_inner) * stride_z_inner
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * w * (z * tl.sigmoid(z))
    else:
        y = y * (1.0 + w)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr,
    stride_x, stride_delta, stride_sum, stride_out, N, eps,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + delta).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_sum + cols, summed, mask=mask)
    # Normalise the *rounded* sum, as the unfused add-then-norm does: the residual stream and
    # its normed copy then agree bit for bit with the two-kernel path.
    s = summed.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = s * tl.rsqrt(tl.sum(s * s, axis=0) / N + eps) * (1.0 + w)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] → a [M, N] view with unit column stride (copies only if it must)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x_rows = _as_rows(x)  # [M, N]
    if z is not None and z.dim() == 3 and z.stride(-1) == 1 and z.shape == x.shape:
        z_arg, z_strides = z, (z.stride(0), z.stride(1), z.shape[1])  # any [T, heads, N] view
    else:
        z_arg = _as_rows(z) if z is not None else x_rows
        z_strides = (z_arg.stride(0), 0, 1)
    out = torch.empty(x_rows.shape, dtype=x.dtype, device=x.device)
    M, N = x_rows.shape
    if M > 0:
        block_n = triton.next_power_of_2(N)
        _rms_norm_kernel[(M,)](
            x_rows, z_arg, weight, out,
            x_rows.stride(0), *z_strides, out.stride(0), N, eps,
            GATED=z is not None, BLOCK_N=block_n, num_warps=_row_warps(block_n),
        )
    return out.view(x.shape)


def _row_warps(block_n: int) -> int:
    """Warps for a whole-row program: ~256 columns per warp, at most 16 warps."""
    return min(16, max(1, block_n // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x) · (1 + weight)` over the last dim; output in x.dtype."""
    return _launch(x, None, weight, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x) · weight · silu(z)` over the last dim; output in x.dtype."""
    return _launch(x, z, weight, eps)


def add_rms_norm(x: torch.Tensor, residual_delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, normed): `sum = x + residual_delta` in x.dtype, `normed = rms_norm(sum)`; both [..., N].

    `num_warps` overrides the per-row default (benchmark sweeps; the model never passes it)."""
    if residual_delta.shape != x.shape:
        raise ValueError(f"add_rms_norm: delta shape {tuple(residual_delta.shape)} != x shape {tuple(x.shape)}")
    x_rows = _as_rows(x)  # [M, N]
    delta_rows = _as_rows(residual_delta)  # [M, N]
    summed = torch.empty(x_rows.shape, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(summed)
    M, N = x_rows.shape
    if M > 0:
        block_n = triton.next_power_of_2(N)
        add_rms_norm_kernel[(M,)](
            x_rows, delta_rows, weight, summed, normed,
            x_rows.stride(0), delta_rows.stride(0), summed.stride(0), normed.stride(0), N, eps,
            BLOCK_N=block_n, num_warps=num_warps or _row_warps(block_n),
        )
    return summed.view(x.shape), normed.view(x.shape)
