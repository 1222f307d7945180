"""batchinfer.kernels.ops dispatch: one table, the Triton kernel on CUDA (raising when it cannot load), the
torch reference on the CPU or under BATCHINFER_KERNELS=ref."""
from __future__ import annotations

import importlib

import pytest
import torch

from batchinfer.kernels import ops
from tests.conftest import requires_cuda


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Clears the resolved-op cache around a test that swaps the loader or the device check."""
    ops.implementation.cache_clear()
    yield monkeypatch
    ops.implementation.cache_clear()


def _fail_triton_imports(monkeypatch) -> None:
    real = importlib.import_module
    triton_packages = {package for package, _ in ops.OPS.values()}

    def fake_import(name):
        if name in triton_packages:
            raise ImportError(f"no module named {name!r} (simulated)")
        return real(name)

    monkeypatch.setattr(ops, "_import_module", fake_import)


def _rms_norm_inputs():
    return torch.randn(3, 8), torch.randn(8)


def test_every_op_is_exported_and_resolves_to_its_triton_kernel_and_its_reference():
    for name, (triton_package, ref_module) in ops.OPS.items():
        assert getattr(ops, name).__name__ == name
        assert ops.implementation(name, True) is getattr(importlib.import_module(triton_package), name)
        assert ops.implementation(name, False) is getattr(importlib.import_module(ref_module), name)


def test_a_triton_kernel_that_cannot_load_raises_for_a_cuda_input(fresh_dispatch):
    _fail_triton_imports(fresh_dispatch)
    fresh_dispatch.setattr(ops, "uses_triton", lambda t: True)  # as if the input lived on CUDA
    fresh_dispatch.delenv("BATCHINFER_KERNELS", raising=False)
    with pytest.raises(ops.KernelLoadError, match=r"batchinfer\.kernels\.ops\.rms_norm: the Triton kernel batchinfer\.kernels\.rmsnorm"
                                                  r"\.rms_norm cannot load .*BATCHINFER_KERNELS=ref"):
        ops.rms_norm(*_rms_norm_inputs(), 1e-6)


def test_cpu_inputs_and_the_ref_switch_run_the_reference_without_loading_triton(fresh_dispatch):
    _fail_triton_imports(fresh_dispatch)
    x, w = _rms_norm_inputs()
    expected = importlib.import_module("batchinfer.kernels.ref.norm").rms_norm(x, w, 1e-6)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), expected)  # CPU input
    fresh_dispatch.setenv("BATCHINFER_KERNELS", "ref")
    assert not ops.uses_triton(torch.empty(0, device="meta"))
    fake_cuda = type("FakeCudaTensor", (), {"is_cuda": True})()
    assert not ops.uses_triton(fake_cuda)  # the switch wins over the device


@requires_cuda
def test_on_cuda_every_op_runs_its_triton_kernel(monkeypatch):
    monkeypatch.delenv("BATCHINFER_KERNELS", raising=False)
    x = torch.empty(1, device="cuda")
    assert ops.uses_triton(x)
    for name, (triton_package, _) in ops.OPS.items():
        impl = ops.implementation(name, ops.uses_triton(x))
        assert impl.__module__.startswith(triton_package), (name, impl.__module__)
