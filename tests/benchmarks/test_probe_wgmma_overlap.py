"""The Gluon block-scaled FP8 GEMM probe (benchmarks/probe_wgmma_overlap.py): compiled for sm_90a
offline, the in-flight variant leaves one wgmma group in flight while it scales the previous
step and the waited one none; on a Hopper GPU both match the fp32 product of the dequantized
operands at a ragged shape, every output element written."""
from __future__ import annotations

import os

import pytest
import torch

from benchmarks.sm90_compile import PTXAS
from tests.sm90_child import sm90_child_output

CHILD = """
from benchmarks.probe_wgmma_overlap import compile_sm90, wgmma_waits
for overlap in (True, False):
    print(overlap, wgmma_waits(compile_sm90(overlap, K=512).asm["ptx"]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton ships no ptxas here")
def test_in_flight_variant_keeps_one_dot_group_in_flight():
    lines = dict(line.split(" ", 1) for line in sm90_child_output(CHILD).strip().splitlines())
    assert lines["True"] == "[1, 0]"  # wait(1) in the loop: the step just issued stays in flight
    assert lines["False"] == "[0, 0, 0]"


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (wgmma, TMA)")
@pytest.mark.parametrize("overlap", [True, False])
def test_matches_the_dequantized_product(overlap):
    from benchmarks.probe_wgmma_overlap import block_scaled_gemm
    from batchinfer.kernels.fp8_gemm.reference import block_dequantize, block_quantize
    from batchinfer.kernels.fp8_gemm.triton_fp8 import quantize_act
    torch.manual_seed(1)
    M, N, K = 300, 384, 768  # rows past a tile's end, six K steps beside a four-slot ring
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wq, ws = block_quantize(torch.randn(N, K, device="cuda") * 0.05)
    ws.mul_(torch.rand_like(ws) + 0.5)  # scales that differ by block, so a misplaced one shows
    xq, xs = quantize_act(x)
    reference = (xq.float() * xs.repeat_interleave(128, dim=1)) @ block_dequantize(wq, ws).t()
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = block_scaled_gemm(xq, xs, wq, ws, overlap=overlap, out=out).float()
    assert not got.isnan().any()
    torch.testing.assert_close(got, reference, rtol=1e-2, atol=1e-2 * reference.abs().max().item())
