"""Test-wide setup: without CUDA, Triton kernels run in the interpreter (tiny shapes); every test
skipped without CUDA is marked `gpu`, so `-m gpu` selects the GPU tests."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (at kernel-module import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

NEEDS_CUDA = "needs CUDA"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
# A test that runs a Triton kernel on CPU tensors needs the interpreter, which is off where CUDA is.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="runs Triton on CPU tensors (the interpreter); gpu tests cover CUDA")


def pytest_collection_modifyitems(items):
    for item in items:
        if any(mark.kwargs.get("reason") == NEEDS_CUDA for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
