"""Triton per-head RMSNorm + partial rotary embedding, fused (reference: kernels/ref/rope.py).

The attention layers normalise q and k per head and then rotate them. Apart, that is one norm
launch (plus a copy: q is a strided view of the projection) and ~11 small torch kernels per
tensor for the rotation — ~350 launches per decode step of the 27B model, each a few µs. Here:
one program per (token, head) loads the row once, computes the norm in fp32, rounds the
normed values to the input dtype (as the unfused norm's output is), rotates the pairs
(i, i + rotary_dim/2) in fp32 and writes the row once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st, eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    x_row = x_ptr + t * stride_xt + h * stride_xh
    out_row = out_ptr + t * stride_ot + h * stride_oh
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)  # [BD]
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * inv_rms * (1.0 + w)).to(out_ptr.dtype.element_ty)  # [BD], rounded as rms_norm's output
    tl.store(out_row + cols, normed, mask=mask & (cols >= 2 * HALF))  # pass-through channels
    # The rotary pairs: both halves reloaded (cache hits) and normalised the same way.
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    x1 = tl.load(x_row + i, mask=m, other=0.0).to(tl.float32)  # [BH]
    x2 = tl.load(x_row + HALF + i, mask=m, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
    n1 = (x1 * inv_rms * (1.0 + w1)).to(out_ptr.dtype.element_ty).to(tl.float32)
    n2 = (x2 * inv_rms * (1.0 + w2)).to(out_ptr.dtype.element_ty).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + i, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + i, mask=m, other=0.0)
    tl.store(out_row + i, (n1 * c - n2 * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(out_row + HALF + i, (n2 * c + n1 * s).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  rotary_dim: int) -> torch.Tensor:
    """x [T, heads, d] (unit stride in d; token / head strides free) → [T, heads, d] contiguous."""
    assert x.stride(-1) == 1, "rms_norm_rope: x must have unit stride in its last dim"
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(-1) == sin.stride(-1) == 1
    T, H, d = x.shape
    out = torch.empty((T, H, d), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    half = rotary_dim // 2
    block_d = triton.next_power_of_2(d)
    _rms_norm_rope_kernel[(T, H)](
        x, weight, cos, sin, out,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0), eps,
        D=d, HALF=half, BLOCK_D=block_d, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        num_warps=max(1, min(4, block_d // 128)),
    )
    return out
