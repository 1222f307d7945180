"""Triton helpers shared by the GDN kernels (prefill and decode): gating and q/k normalisation.

They mirror kernels/ref/gdn.py exactly (same eps, same softplus threshold) so that the Triton
path and the reference differ only by rounding.
"""
from __future__ import annotations

import triton
import triton.language as tl

L2NORM_EPS = tl.constexpr(1e-6)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch.nn.functional.softplus's default: linear above it


@triton.jit
def gdn_gate_terms(a, b, A_log, dt_bias):
    """fp32 (g, beta): g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b)."""
    x = a + dt_bias
    softplus = tl.where(x > SOFTPLUS_THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))))
    return -tl.exp(A_log) * softplus, tl.sigmoid(b)


@triton.jit
def l2_normalise_vector(x):
    """x / sqrt(Σx² + eps) for one fp32 head vector [d]."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + L2NORM_EPS)


@triton.jit
def l2_normalise_rows(x):
    """Row-wise x / sqrt(Σx² + eps) for an fp32 tile [rows, d] (one head vector per row)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + L2NORM_EPS)[:, None]


def next_pow2_at_least_16(n: int) -> int:
    """Tile width for a head dim: a power of two, ≥ 16 so that tl.dot accepts it."""
    return max(16, triton.next_power_of_2(n))
