"""MoE combine (`moe_combine`): each token's k weighted expert rows plus its gated shared expert.

The reference is exactly the combine the MoE layer ran before the op existed (fp32 products,
one `index_add_` over the expert-sorted rows, the shared expert times the fp32 sigmoid of its gate
logit), so CPU parity with transformers is untouched.
The Triton kernel against it: in the interpreter on CPU at tiny shapes, on CUDA at the 35B-A3B
shapes; outputs allocated NaN-filled so an element the kernel forgets to write fails.
"""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import ops
from batchinfer.kernels.moe_combine import combine as tri
from batchinfer.kernels.ref import moe_combine as ref
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(T: int, E: int, k: int, seed: int):
    """Random top-k routing and the expert-sorted layout SparseMoE builds: (order, slot [T, k], weights [T, k])."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])  # [T, k] distinct per token
    weights = torch.rand(T, k, generator=gen).softmax(-1)  # [T, k] fp32
    order = torch.argsort(experts.reshape(-1), stable=True)  # [T·k]
    slot = torch.empty_like(order)
    slot[order] = torch.arange(T * k)
    return order, slot.view(T, k), weights


def _inputs(T: int, H: int, E: int, k: int, dtype: torch.dtype, seed: int, device: str = DEVICE):
    gen = torch.Generator().manual_seed(seed + 100)
    order, slot, weights = _routing(T, E, k, seed)
    y = torch.randn(T * k, H + 7, generator=gen).to(dtype)[:, 3:3 + H]  # strided rows, as a kernel's column slice
    shared = torch.randn(T, H, generator=gen).to(dtype)
    gate = torch.randn(T, 1, generator=gen).to(dtype) * 3  # the shared expert's gate logits, in the activation dtype
    return [t.to(device) for t in (y, slot, weights, shared, gate)], order.to(device)


def test_reference_is_the_layers_former_combine_bit_for_bit():
    (y, slot, weights, shared, gate), order = _inputs(37, 64, 16, 4, torch.float32, seed=1, device="cpu")
    k = slot.shape[1]
    former = torch.zeros(37, 64).index_add_(0, order // k, y.float() * weights.reshape(-1)[order, None])
    assert torch.equal(ref.moe_combine(y, slot, weights, shared, gate), former + shared * torch.sigmoid(gate))


def test_ops_register_the_triton_kernel():
    assert ops.implementation("moe_combine", True) is tri.moe_combine
    assert ops.implementation("moe_combine", False) is ref.moe_combine


@pytest.fixture
def nan_outputs(monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (lambda t: t.fill_(float("nan")) if t.is_floating_point()
                                                          else t)(real_empty(*a, **kw)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,E,k", [(1, 96, 8, 2), (19, 130, 12, 8), (5, 1100, 10, 10)])
def test_triton_matches_reference(nan_outputs, dtype, T, H, E, k):
    (y, slot, weights, shared, gate), _ = _inputs(T, H, E, k, dtype, seed=T + H)
    launch = tri.MoeCombineLaunch(block=64 if DEVICE == "cpu" else 1024)  # odd H: masked tails in every block
    out = tri.moe_combine(y, slot, weights, shared, gate, launch)
    expected = ref.moe_combine(y.cpu(), slot.cpu(), weights.cpu(), shared.cpu(), gate.cpu())
    assert out.dtype == dtype and out.isfinite().all()
    # fp32: the same products summed in another order; bf16: one rounding each side (the interpreter truncates)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(out.cpu().float(), expected.float(), **tol)


@requires_cuda
def test_triton_at_the_35b_a3b_shapes_on_cuda(nan_outputs):
    (y, slot, weights, shared, gate), _ = _inputs(2048, 2048, 256, 8, torch.bfloat16, seed=3)
    out = ops.moe_combine(y, slot, weights, shared, gate)
    expected = ref.moe_combine(y.float(), slot, weights, shared.float(), gate)
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=2 ** -7)
