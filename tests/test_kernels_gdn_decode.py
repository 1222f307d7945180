"""Triton GDN decode (kernels/gdn_decode.py), every launch variant, vs the fp32 reference.

CPU runs the kernel in the Triton interpreter (tests/conftest.py) at tiny shapes: H_k=2, H_v=4
(a wrong key-head mapping shows), several sequences on out-of-order slots of a larger pool whose
other slots must stay bit-identical, two chained steps, fp32 and bf16 pools, head dims that fill
the tile exactly and ones that do not (d_k 24, d_v 48: the masked path), NaN-poisoned outputs.
The persistent variant runs with fewer programs than tiles, so every program loops. CUDA repeats
each variant at the model's shapes in bf16.
"""
from __future__ import annotations

import pytest
import torch

from kernels import gdn_decode as tri
from kernels._common import KernelLaunch
from kernels.ref import gdn as ref
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS = 9
SLOTS = [5, 2, 7, 0]  # out of order; slots 1, 3, 4, 6, 8 must stay untouched

LAUNCHES = {
    "default": tri.DEFAULT_LAUNCH,
    "kernel-launch": KernelLaunch(block_v=16, num_warps=2, num_stages=1),  # the older knob type
    "one-warp": tri.DecodeLaunch(block_v=32, num_warps=1),  # d_k reductions inside one warp
    "persistent": tri.DecodeLaunch(block_v=16, num_warps=4, num_stages=3, variant="persistent", programs_per_sm=3),
    "persistent-one-warp": tri.DecodeLaunch(block_v=32, num_warps=1, num_stages=2, variant="persistent",
                                            programs_per_sm=2),
    "tile-tma": tri.DecodeLaunch(block_v=32, num_warps=4, tma=True),
    "persistent-tma": tri.DecodeLaunch(block_v=16, num_warps=2, num_stages=3, variant="persistent",
                                       programs_per_sm=3, tma=True),
}


def make_step(num_seqs, H_k, H_v, d_k, d_v, seed, dtype=torch.float32, device=DEVICE):
    """Fresh random inputs of one decode step (never zeros); gate parameters from seed 0 so that
    chained steps share them."""
    gen = torch.Generator().manual_seed(seed)
    params = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    return dict(
        q=rnd(num_seqs, H_k, d_k), k=rnd(num_seqs, H_k, d_k), v=rnd(num_seqs, H_v, d_v),
        a=rnd(num_seqs, H_v), b=rnd(num_seqs, H_v, scale=2.0),
        A_log=(torch.rand(H_v, generator=params) * 2 - 1.5).to(device),  # decays from mild to strong
        dt_bias=torch.randn(H_v, generator=params).to(device),
    )


def random_pool(H_v, d_k, d_v, dtype, seed=99, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_SLOTS, H_v, d_k, d_v, generator=gen) * 0.5).to(device, dtype)


def run_poisoned(step, pool, slots, launch):
    """The kernel writes into a NaN-filled output, so any element it skips fails the comparison."""
    B, H_v, d_v = step["v"].shape
    out = torch.full((B, H_v, d_v), float("nan"), dtype=step["q"].dtype, device=pool.device)
    got = tri.gdn_decode(**step, state=pool, slots=slots, launch=launch, out=out)
    assert got.data_ptr() == out.data_ptr()
    return got


FP32, BF16 = torch.float32, torch.bfloat16
FULL_TILE, MASKED = (16, 32), (24, 48)  # (d_k, d_v): tiles that fit the head exactly, and ones that overhang
CASES = [(name, FP32, FULL_TILE) for name in LAUNCHES] + [(name, BF16, MASKED) for name in LAUNCHES] + [
    ("persistent", FP32, MASKED)]


@pytest.mark.parametrize("launch_name,pool_dtype,dims", CASES,
                         ids=[f"{n}-{str(t)[6:]}-{'full' if d == FULL_TILE else 'masked'}" for n, t, d in CASES])
def test_decode_matches_reference(launch_name, pool_dtype, dims):
    d_k, d_v = dims
    launch, H_k, H_v = LAUNCHES[launch_name], 2, 4
    slots = torch.tensor(SLOTS, device=DEVICE)
    pool = random_pool(H_v, d_k, d_v, pool_dtype)
    assert tri._tma_can_load(pool) or not tri.as_decode_launch(launch).tma  # a tma launch must not fall back here
    expect_pool, original = pool.clone(), pool.clone()
    # A bf16 pool may round one ulp differently (Triton's exp vs torch's), and the next step sees it.
    tol = dict(rtol=2e-5, atol=2e-5) if pool_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for seed in (1, 2):  # two chained steps: the second reads the state the first wrote
        step = make_step(len(SLOTS), H_k, H_v, d_k, d_v, seed)
        expect = ref.gdn_decode(**step, state=expect_pool, slots=slots)
        got = run_poisoned(step, pool, slots, launch)
        torch.testing.assert_close(got, expect, **tol)
        torch.testing.assert_close(pool.float(), expect_pool.float(), **tol)
    unused = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(pool[unused], original[unused])


@pytest.mark.parametrize("launch_name", ["default", "persistent-tma"])
def test_decode_bf16_inputs_single_sequence(launch_name):
    """bf16 q/k/v (the model's dtype) vs the fp32 reference on the same rounded inputs; B = 1,
    so the persistent grid is capped at the tile count."""
    slots = torch.tensor([6], device=DEVICE)
    step = make_step(1, 2, 4, 16, 48, seed=3, dtype=torch.bfloat16)
    pool = random_pool(4, 16, 48, torch.float32)
    expect_pool = pool.clone()
    expect = ref.gdn_decode(**{n: t.float() for n, t in step.items()}, state=expect_pool, slots=slots)
    got = run_poisoned(step, pool, slots, LAUNCHES[launch_name])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expect.float(), rtol=1e-2, atol=1e-2)  # bf16 output rounding
    torch.testing.assert_close(pool, expect_pool, rtol=2e-5, atol=2e-5)


def test_persistent_programs_loop():
    """The persistent test launches have fewer programs than tiles (one 'SM' off CUDA)."""
    if DEVICE == "cuda":
        pytest.skip("grid size depends on the GPU's SM count")
    launch = LAUNCHES["persistent"]
    tiles = len(SLOTS) * 4 * 2  # sequences × value heads × d_v blocks of 16 (d_v 32)
    assert launch.programs_per_sm * tri._multiprocessor_count(torch.device(DEVICE)) < tiles


def test_launch_validation():
    with pytest.raises(ValueError, match="variant"):
        tri.DecodeLaunch(variant="bogus")
    assert tri.as_decode_launch(KernelLaunch(64, 4, 2)) == tri.DecodeLaunch(64, 4, 2, "tile")


def test_tma_falls_back_on_misaligned_strides():
    """d_v = 6 (24-byte fp32 rows) cannot be a TMA descriptor: the launch loads through pointers."""
    pool = random_pool(4, 16, 6, torch.float32)
    assert not tri._tma_can_load(pool)
    slots = torch.tensor(SLOTS[:2], device=DEVICE)
    step = make_step(2, 2, 4, 16, 6, seed=5)
    expect_pool = pool.clone()
    expect = ref.gdn_decode(**step, state=expect_pool, slots=slots)
    got = run_poisoned(step, pool, slots, LAUNCHES["persistent-tma"])
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pool, expect_pool, rtol=2e-5, atol=2e-5)


@requires_cuda
@pytest.mark.parametrize("launch_name", list(LAUNCHES))
def test_decode_model_shapes_cuda(launch_name):
    """Qwen3.5-27B's GDN (16 key / 48 value heads × 128), bf16 inputs, fp32 pool, 130 sequences."""
    step = make_step(130, 16, 48, 128, 128, seed=4, dtype=torch.bfloat16)
    state = torch.randn(200, 48, 128, 128, device="cuda") * 0.5
    slots = torch.randperm(200, device="cuda")[:130]
    expect_state = state.clone()
    expect = ref.gdn_decode(**{n: t.float() for n, t in step.items()}, state=expect_state, slots=slots)
    got = run_poisoned(step, state, slots, LAUNCHES[launch_name])
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()  # noqa: E731
    assert rel(got, expect) < 5e-3
    assert rel(state, expect_state) < 1e-5


@requires_cuda
def test_decode_sweep_launches_cuda():
    """Every launch benchmarks/bench_gdn.py sweeps gives the reference's answer (B = 130)."""
    from benchmarks.bench_gdn import DECODE_SWEEP

    step = make_step(130, 16, 48, 128, 128, seed=6, dtype=torch.bfloat16)
    state0 = torch.randn(200, 48, 128, 128, device="cuda") * 0.5
    slots = torch.randperm(200, device="cuda")[:130]
    expect_state = state0.clone()
    expect = ref.gdn_decode(**{n: t.float() for n, t in step.items()}, state=expect_state, slots=slots)
    for config in DECODE_SWEEP:
        state = state0.clone()
        got = run_poisoned(step, state, slots, tri.DecodeLaunch(*config))
        torch.testing.assert_close(got.float(), expect.float(), rtol=2e-2, atol=2e-2, msg=str(config))
        torch.testing.assert_close(state, expect_state, rtol=1e-4, atol=1e-4, msg=str(config))
