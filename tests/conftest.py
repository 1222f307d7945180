"""Test-wide setup: without CUDA, Triton kernels run in the interpreter (tiny shapes)."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (at kernel-module import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
