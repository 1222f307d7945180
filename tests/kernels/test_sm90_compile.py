"""benchmarks/sm90_compile.py (offline sm_90a compile of the prefill kernels, no GPU) keeps up with
the kernels' signatures: every runtime argument needs a type there, and a new one (the prefill's
chunk range) broke it without any test noticing. Run in a child process: the test session may
have the Triton interpreter on, which cannot compile."""
from __future__ import annotations

import os

import pytest

from benchmarks.sm90_compile import PTXAS
from tests.sm90_child import sm90_child_output

pytestmark = [pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton ships no ptxas here"),
              pytest.mark.slow]  # compiles every prefill kernel for sm_90a

CHILD = """
import re
from benchmarks import sm90_compile as S
for kernel, warps in (("wy", 1), ("state_pass", 4), ("output", 4)):
    ptx = S.compile_sm90(S.KERNELS[kernel], block_v=64, num_warps=warps, num_stages=2).asm["ptx"]
    registers, _ = S.ptxas_resources(ptx)
    products = len(re.findall(r"^\\s*(?:mma\\.sync|wgmma\\.mma_async)", ptx, flags=re.M))
    print(kernel, registers, products)
"""


def test_prefill_kernels_compile_for_sm90():
    output = sm90_child_output(CHILD)
    rows = {kernel: (int(regs), int(mma)) for kernel, regs, mma in map(str.split, output.splitlines())}
    assert set(rows) == {"wy", "state_pass", "output"}
    for kernel, (registers, products) in rows.items():
        assert 0 < registers <= 255 and products > 0, (kernel, registers, products)  # tensor-core products
