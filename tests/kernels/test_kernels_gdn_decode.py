"""Triton GDN decode (kernels/gdn_decode/decode.py), every launch variant, vs the fp32 reference.

CPU runs the kernel in the Triton interpreter (tests/conftest.py) at tiny shapes: H_k=2, H_v=4
(a wrong key-head mapping shows), several sequences on out-of-order slots of a larger pool whose
other slots must stay bit-identical, two chained steps, fp32 and bf16 pools, head dims that fill
the tile exactly and ones that do not (d_k 24, d_v 48: the masked path), NaN-poisoned outputs.
The persistent variant runs with fewer programs than tiles, so every program loops. CUDA repeats
each variant at the model's shapes in bf16.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from batchinfer.kernels.gdn_decode import decode as tri
from batchinfer.kernels._common import KernelLaunch, multiprocessor_count
from batchinfer.kernels.ref import gdn as ref
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS = 9
SLOTS = [5, 2, 7, 0]  # out of order; slots 1, 3, 4, 6, 8 must stay untouched

LAUNCHES = {
    "default": tri.DEFAULT_LAUNCH,
    "small-batch": tri.SMALL_BATCH_LAUNCH,
    "large-batch": tri.LARGE_BATCH_LAUNCH,
    "kernel-launch": KernelLaunch(block_v=16, num_warps=2, num_stages=1),  # the older knob type
    "one-warp": tri.DecodeLaunch(block_v=32, num_warps=1),  # d_k reductions inside one warp
    "persistent": tri.DecodeLaunch(block_v=16, num_warps=4, num_stages=3, variant="persistent", programs_per_sm=3),
    "persistent-one-warp": tri.DecodeLaunch(block_v=32, num_warps=1, num_stages=2, variant="persistent",
                                            programs_per_sm=2),
    "tile-tma": tri.DecodeLaunch(block_v=32, num_warps=4, tma=True),
    "persistent-tma": tri.DecodeLaunch(block_v=16, num_warps=2, num_stages=3, variant="persistent",
                                       programs_per_sm=3, tma=True),
    # Issue-3 knobs: streaming cache hints on the state tile, a/b loaded one tile ahead, a d_v block
    # wider than the head (one masked block per head), and all of them over TMA.
    "tile-stream": tri.DecodeLaunch(block_v=16, num_warps=2, stream_state=True),
    "persistent-stream": tri.DecodeLaunch(block_v=16, num_warps=2, num_stages=3, variant="persistent",
                                          programs_per_sm=3, stream_state=True),
    "persistent-gates-ahead": tri.DecodeLaunch(block_v=16, num_warps=2, num_stages=3, variant="persistent",
                                               programs_per_sm=3, gates_ahead=True),
    "persistent-wide-stream-ahead": tri.DecodeLaunch(block_v=64, num_warps=4, num_stages=3, variant="persistent",
                                                     programs_per_sm=3, stream_state=True, gates_ahead=True),
    "persistent-tma-stream-ahead": tri.DecodeLaunch(block_v=32, num_warps=2, num_stages=3, variant="persistent",
                                                    programs_per_sm=5, tma=True, stream_state=True, gates_ahead=True),
}
ISSUE3_LAUNCHES = ["default", "tile-stream", "persistent-stream", "persistent-gates-ahead",
                   "persistent-wide-stream-ahead", "persistent-tma-stream-ahead"]


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
# The issue-3 launches run in test_decode_batch_sizes (both pool dtypes, both tile fits) instead.
CHAINED = [name for name in LAUNCHES if name == "default" or name not in ISSUE3_LAUNCHES]
CASES = [(name, FP32, FULL_TILE) for name in CHAINED] + [(name, BF16, MASKED) for name in CHAINED] + [
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


BATCH_CASES = [(1, FP32, MASKED), (3, BF16, MASKED), (17, FP32, FULL_TILE)]


@pytest.mark.parametrize("num_seqs,pool_dtype,dims", BATCH_CASES, ids=["B1", "B3", "B17"])
@pytest.mark.parametrize("launch_name", ISSUE3_LAUNCHES)
def test_decode_batch_sizes(launch_name, num_seqs, pool_dtype, dims):
    """B = 1, 3, 17 on a random permutation of a 24-slot pool: the persistent programs then run
    unequal numbers of tiles (the gates-ahead index is clamped on each program's last tile), and
    with B = 1 the grid is capped at the tile count."""
    d_k, d_v = dims
    gen = torch.Generator().manual_seed(num_seqs)
    pool = (torch.randn(24, 4, d_k, d_v, generator=gen) * 0.5).to(DEVICE, pool_dtype)
    slots = torch.randperm(24, generator=gen)[:num_seqs].to(DEVICE)
    expect_pool, original = pool.clone(), pool.clone()
    step = make_step(num_seqs, 2, 4, d_k, d_v, seed=10 + num_seqs)
    expect = ref.gdn_decode(**step, state=expect_pool, slots=slots)
    got = run_poisoned(step, pool, slots, LAUNCHES[launch_name])
    tol = dict(rtol=2e-5, atol=2e-5) if pool_dtype == FP32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expect, **tol)
    torch.testing.assert_close(pool.float(), expect_pool.float(), **tol)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(pool[untouched.to(DEVICE)], original[untouched.to(DEVICE)])


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
    assert launch.programs_per_sm * multiprocessor_count(torch.device(DEVICE)) < tiles


def test_launch_for_batch_follows_the_measured_ladder():
    assert tri.launch_for_batch(1) is tri.launch_for_batch(31) is tri.SMALL_BATCH_LAUNCH
    assert tri.launch_for_batch(32) is tri.launch_for_batch(127) is tri.DEFAULT_LAUNCH
    assert tri.launch_for_batch(128) is tri.launch_for_batch(4096) is tri.LARGE_BATCH_LAUNCH


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


def _sm90_ptx(launch: tri.DecodeLaunch) -> str:
    """PTX of the decode kernel compiled for sm_90a at the model's shapes (Triton's bundled ptxas
    assembles it, so a rejected instruction raises; no GPU needed). Call with TRITON_INTERPRET=0."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    H_v, d = 48, 128
    ints = dict(stride_qb=16 * d, stride_qh=d, stride_kb=16 * d, stride_kh=d, stride_vb=H_v * d, stride_vh=d,
                stride_ab=H_v, stride_bb=H_v, stride_s0=H_v * d * d, stride_s1=d * d, stride_ob=H_v * d,
                stride_oh=d, num_tiles=128 * H_v * (d // launch.block_v))
    persistent = launch.variant == "persistent"
    constexprs = dict(state_desc=None, H_V=H_v, D_K=d, D_V=d, STRIDE_S2=d, GROUP=3, BLOCK_K=d, BLOCK_V=launch.block_v,
                      PERSISTENT=persistent, NUM_STAGES=launch.num_stages, USE_TMA=False, LOOP_AS_WHILE=False,
                      GATES_AHEAD=persistent and launch.gates_ahead, **tri._state_cache_hints(launch.stream_state))
    names = tri._gdn_decode_kernel.arg_names
    signature, aligned = {}, []
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):  # as the model calls it: bf16 activations, fp32 params and pool
            fp32 = name in ("A_log_ptr", "dt_bias_ptr", "state_ptr")
            signature[name] = "*fp32" if fp32 else "*i64" if name == "slots_ptr" else "*bf16"
            aligned.append(i)
        else:  # the launcher specialises integers divisible by 16
            signature[name] = "fp32" if name == "scale" else "i32"
            aligned += [i] if name != "scale" and ints[name] % 16 == 0 else []
    source = ASTSource(tri._gdn_decode_kernel, signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


SM90_LAUNCHES = {
    "tile": tri.DecodeLaunch(block_v=32, num_warps=8, stream_state=True),
    "persistent": tri.DecodeLaunch(block_v=32, num_warps=2, num_stages=3, variant="persistent", programs_per_sm=6,
                                   stream_state=True, gates_ahead=True),
}


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="the CUDA tests run these launches for real")
def test_stream_hints_compile_for_sm90(tmp_path):
    """ptxas accepts the hinted loads and stores (it rejects .cg combined with an eviction policy),
    the state is stored streaming, and the persistent loop still prefetches state tiles by cp.async.
    Compiled in a child process: the interpreter (set for this one) cannot compile for a GPU."""
    script = ("import sys; from tests.kernels.test_kernels_gdn_decode import SM90_LAUNCHES, _sm90_ptx\n"
              "for name, launch in SM90_LAUNCHES.items():\n"
              "    open(f'{sys.argv[1]}/{name}.ptx', 'w').write(_sm90_ptx(launch))\n")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    tile, persistent = ((tmp_path / f"{name}.ptx").read_text() for name in ("tile", "persistent"))
    assert "ld.global.L1::evict_first.L2::cache_hint.v4" in tile and "st.global.cs.v4" in tile
    assert "cp.async.cg.shared.global" in persistent  # the pipeliner's prefetch (it drops the load hint)
    assert "st.global.cs.v4" in persistent
