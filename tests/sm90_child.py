"""Run a script that compiles kernels for sm_90a offline (no GPU), in a child process: the test
session may have the Triton interpreter on, which cannot compile. Skips where Triton ships no ptxas."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def sm90_child_output(script: str, timeout: int = 300) -> str:
    """The child's stdout; fails the test with the child's stderr when it exits non-zero."""
    from benchmarks.sm90_compile import PTXAS

    if not os.path.exists(PTXAS):
        pytest.skip("Triton ships no ptxas here")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout
