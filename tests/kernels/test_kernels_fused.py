"""Fused SwiGLU activation (`silu_mul`) and fused residual add + RMSNorm (`add_rms_norm`).

References: exactly the unfused torch maths they replace (bit for bit in fp32, so CPU parity
with transformers is untouched). Triton kernels vs references: on CPU in the interpreter at
tiny shapes (tests/conftest.py), on CUDA again at the qwen3.5-27b shapes. Outputs are
allocated NaN-filled (`poisoned_empty`) so an element a kernel forgets to write fails.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchinfer.kernels import activation as tri_act
from batchinfer.kernels import ops
from batchinfer.kernels.rmsnorm import rmsnorm as tri_norm
from batchinfer.kernels.ref import activation as ref_act
from batchinfer.kernels.ref import norm as ref_norm
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
ROWS = [1, 5, 65]
WIDTHS = [127, 4096 + 3]  # odd: masked tails in every block, never a power of two
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    # bf16: both sides compute in fp32 and round once; they may still land one ulp apart.
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)


def _sum_tol(dtype: torch.dtype) -> dict:
    """The residual sum is one fp32 add rounded to x.dtype on both sides: identical on a GPU. The
    Triton interpreter (CPU) truncates fp32 -> bf16 instead of rounding to nearest even, so
    there a bf16 sum may sit one ulp (2^-7 relative) below torch's."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        return dict(rtol=2.0 ** -7, atol=0.0)
    return dict(rtol=0.0, atol=0.0)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def _column_slice(rows: int, width: int, dtype: torch.dtype, seed: int, spare: int = 13) -> torch.Tensor:
    """A [rows, width] view into a tensor `spare` columns wider: row stride > width, unit column stride."""
    wide = _randn(rows, width + spare, dtype=dtype, seed=seed)
    return wide[:, 5:5 + width]


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like hand out NaN-filled float tensors while the test runs."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


# --- references --------------------------------------------------------------------------------


def test_ref_silu_mul_is_exactly_torch_swiglu_in_fp32():
    gate_up = _column_slice(65, 2 * 127, torch.float32, seed=1).cpu()
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ref_act.silu_mul(gate_up), F.silu(gate) * up)


def test_ref_silu_mul_rounds_once_in_bf16():
    gate_up = _randn(5, 2 * 127, dtype=torch.bfloat16, seed=2).cpu()
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert torch.equal(ref_act.silu_mul(gate_up), (F.silu(gate) * up).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_add_rms_norm_is_exactly_add_then_norm(dtype):
    x = _randn(65, 127, dtype=dtype, seed=3).cpu()
    delta = _randn(65, 127, dtype=dtype, seed=4).cpu()
    weight = _randn(127, dtype=dtype, seed=5, scale=0.3).cpu()
    summed, normed = ref_norm.add_rms_norm(x, delta, weight, EPS)
    assert summed.dtype == normed.dtype == dtype
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, ref_norm.rms_norm(x + delta, weight, EPS))


def test_ops_register_the_triton_kernels():
    assert ops.implementation("silu_mul", True) is tri_act.silu_mul
    assert ops.implementation("add_rms_norm", True) is tri_norm.add_rms_norm
    assert ops.implementation("silu_mul", False) is ref_act.silu_mul
    assert ops.implementation("add_rms_norm", False) is ref_norm.add_rms_norm


# --- Triton vs reference (interpreter on CPU) ------------------------------------------------


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("intermediate", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_silu_mul_matches_reference(poisoned_empty, rows, intermediate, dtype):
    gate_up = _column_slice(rows, 2 * intermediate, dtype, seed=rows + intermediate)
    gate_up[0, 0] = -30.0  # silu's saturating tail: sigmoid underflows towards 0, no NaN
    got = tri_act.silu_mul(gate_up)
    assert got.shape == (rows, intermediate) and got.dtype == dtype
    torch.testing.assert_close(got, ref_act.silu_mul(gate_up), **_tol(dtype))


def test_triton_silu_mul_small_blocks_and_leading_dims(poisoned_empty):
    """Several column blocks per row with a ragged tail; [B, S, 2I] keeps its leading dims."""
    gate_up = _randn(3, 5, 2 * 127, dtype=torch.float32, seed=7)
    got = tri_act.silu_mul(gate_up, tri_act.SiluMulLaunch(block=32, num_warps=1))
    assert got.shape == (3, 5, 127)
    torch.testing.assert_close(got, ref_act.silu_mul(gate_up), rtol=1e-5, atol=1e-5)


def test_triton_silu_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        tri_act.silu_mul(torch.randn(2, 7, device=DEVICE))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_add_rms_norm_matches_reference(poisoned_empty, rows, width, dtype):
    x = _column_slice(rows, width, dtype, seed=rows)  # strided rows, different strides
    delta = _column_slice(rows, width, dtype, seed=rows + 100, spare=29)
    weight = _randn(width, dtype=dtype, seed=width, scale=0.3)
    got_sum, got_norm = tri_norm.add_rms_norm(x, delta, weight, EPS)
    expect_sum, expect_norm = ref_norm.add_rms_norm(x, delta, weight, EPS)
    torch.testing.assert_close(got_sum, expect_sum, **_sum_tol(dtype))
    torch.testing.assert_close(got_norm, expect_norm, **_tol(dtype))


def test_triton_add_rms_norm_keeps_leading_dims(poisoned_empty):
    x = _randn(2, 3, 127, dtype=torch.bfloat16, seed=11)
    delta = _randn(2, 3, 127, dtype=torch.bfloat16, seed=12)
    weight = _randn(127, dtype=torch.bfloat16, seed=13, scale=0.3)
    got_sum, got_norm = tri_norm.add_rms_norm(x, delta, weight, EPS)
    expect_sum, expect_norm = ref_norm.add_rms_norm(x, delta, weight, EPS)
    assert got_sum.shape == got_norm.shape == (2, 3, 127)
    torch.testing.assert_close(got_sum, expect_sum, **_sum_tol(torch.bfloat16))
    torch.testing.assert_close(got_norm, expect_norm, **_tol(torch.bfloat16))


def test_triton_add_rms_norm_rejects_mismatched_delta():
    with pytest.raises(ValueError, match="shape"):
        tri_norm.add_rms_norm(torch.randn(4, 8, device=DEVICE), torch.randn(1, 8, device=DEVICE),
                              torch.randn(8, device=DEVICE), EPS)


# --- CUDA, qwen3.5-27b shapes (decode batch 256) -------------------------------------------------


@requires_cuda
def test_cuda_silu_mul_model_shape_bf16(poisoned_empty):
    gate_up = _column_slice(256, 2 * 17408, torch.bfloat16, seed=21)
    torch.testing.assert_close(tri_act.silu_mul(gate_up), ref_act.silu_mul(gate_up), **_tol(torch.bfloat16))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_add_rms_norm_model_shape(poisoned_empty, dtype):
    x = _column_slice(256, 5120, dtype, seed=22)
    delta = _randn(256, 5120, dtype=dtype, seed=23)
    weight = _randn(5120, dtype=dtype, seed=24, scale=0.3)
    got_sum, got_norm = tri_norm.add_rms_norm(x, delta, weight, EPS)
    expect_sum, expect_norm = ref_norm.add_rms_norm(x, delta, weight, EPS)
    torch.testing.assert_close(got_sum, expect_sum, **_sum_tol(dtype))  # exact on CUDA
    torch.testing.assert_close(got_norm, expect_norm, **_tol(dtype))


# ---- rms_norm_rope: per-head q/k norm + partial rotary, fused --------------------------------

def _rope_case(T: int, heads: int, d: int, rot: int, dtype: torch.dtype, seed: int):
    """A strided [T, heads, d] view (as q inside the attention projection: heads interleaved
    with their gates), weights, and fp32 cos / sin of random positions."""
    wide = _randn(T, heads, 2 * d, dtype=dtype, seed=seed)
    x = wide[:, :, :d]  # row stride 2·heads·d, head stride 2d
    weight = _randn(d, dtype=dtype, seed=seed + 1, scale=0.3)
    angles = torch.rand(T, rot // 2, generator=torch.Generator().manual_seed(seed + 2)) * 100.0
    return x, weight, angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, heads, d, rot", [(5, 3, 24, 8), (65, 2, 40, 40), (3, 1, 17, 6)])
def test_triton_rms_norm_rope_matches_reference(poisoned_empty, dtype, T, heads, d, rot):
    """Partial rotation (rot < d), a fully rotated head (rot = d), d not a power of two."""
    from batchinfer.kernels import rope as tri_rope
    from batchinfer.kernels.ref import rope as ref_rope

    x, weight, cos, sin = _rope_case(T, heads, d, rot, dtype, seed=T + d)
    expect = ref_rope.rms_norm_rope(x, weight, cos, sin, EPS, rot)
    got = tri_rope.rms_norm_rope(x, weight, cos, sin, EPS, rot)
    # bf16: the normed values round once, then the rotation rounds once; one ulp either way.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expect, **tol)


def test_reference_rms_norm_rope_is_norm_then_rotation():
    """The reference equals its definition: rms_norm, then rotate-half on the first rot channels
    (checked against an explicit complex-number rotation of each pair)."""
    from batchinfer.kernels.ref import rope as ref_rope

    x, weight, cos, sin = _rope_case(4, 2, 12, 8, torch.float32, seed=3)
    got = ref_rope.rms_norm_rope(x, weight, cos, sin, EPS, 8)
    normed = ref_norm.rms_norm(x, weight, EPS)
    pairs = torch.complex(normed[..., :4], normed[..., 4:8]) * torch.complex(cos, sin)[:, None, :]
    torch.testing.assert_close(got[..., :4], pairs.real, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[..., 4:8], pairs.imag, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[..., 8:], normed[..., 8:], rtol=0, atol=0)


@requires_cuda
def test_triton_rms_norm_rope_27b_shape(poisoned_empty):
    """qwen3.5-27b attention: 24 query heads × 256, rotary 64 channels, batch 256, bf16."""
    from batchinfer.kernels import rope as tri_rope
    from batchinfer.kernels.ref import rope as ref_rope

    x, weight, cos, sin = _rope_case(256, 24, 256, 64, torch.bfloat16, seed=11)
    expect = ref_rope.rms_norm_rope(x, weight, cos, sin, EPS, 64)
    torch.testing.assert_close(tri_rope.rms_norm_rope(x, weight, cos, sin, EPS, 64), expect, rtol=2e-2, atol=2e-2)
