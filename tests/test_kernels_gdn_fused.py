"""Fused GDN state pass + outputs (kernels/gdn_state_output.py) vs the token-by-token reference.

Each case runs the real earlier stages (q/k L2-norm, WY) from kernels/gdn_prefill.py, then the
fused kernel on a NaN-poisoned output, and checks the outputs and the final states in the pool.
On CPU the kernels run in the Triton interpreter (tests/conftest.py) at tiny shapes: H_k = 2,
H_v = 4 (a wrong key-head mapping shows), chunk 64 with lengths 65/1/64/130/63, slots out of
order, a non-zero initial state, slots that must stay untouched, and d_v = 48 (not a power of
two) with block_v below, at and above the padded d_v. CUDA repeats it at model shapes in bf16.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import gdn_prefill as prefill
from kernels._common import KernelLaunch
from kernels.gdn_state_output import DEFAULT_STATE_OUTPUT_LAUNCH, run_state_output
from kernels.ref import gdn as ref
from tests.conftest import requires_cuda
from tests.test_kernels_gdn import NUM_SLOTS, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (conftest)
LENGTHS = [65, 1, 64, 130, 63]
SLOTS = [5, 2, 7, 0, 3]
WY_LAUNCH = KernelLaunch(block_v=64, num_warps=8, num_stages=1)


def _planned_work(x, state, slots, cu):
    """A PrefillWork with the stages before the fused one done (normalised q/k, G, W, U)."""
    work = prefill.plan_prefill(**x, state=state, slots=slots, cu_seqlens=cu)
    prefill.run_l2norm(work)
    prefill.run_wy(work, WY_LAUNCH)
    return work


def _run_fused(work, state, launch):
    """The fused stage on `work`'s intermediates with its own state pool and a NaN-poisoned output."""
    run = replace(work, state=state, out=torch.full_like(work.out, float("nan")))
    run_state_output(run, launch)
    return run.out


def _untouched(slots):
    return [s for s in range(NUM_SLOTS) if s not in slots.tolist()]


def _rel_err(got, expect) -> float:
    return ((got.float() - expect.float()).norm() / expect.float().norm()).item()


@pytest.fixture(scope="module", params=[dict(d_v=48, H_k=2, H_v=4), dict(d_v=32, H_k=1, H_v=2)],
                ids=lambda p: f"dv{p['d_v']}")
def prepared(request):
    """Inputs, their planned work (WY done once per shape: it is the slow part in the interpreter)
    and the token-recurrence ground truth."""
    x, state, cu = make_inputs(LENGTHS, device=DEVICE, seed=21, **request.param)
    slots = torch.tensor(SLOTS, device=DEVICE)
    expect_state = state.clone()
    expect = ref.gdn_recurrent_reference(**x, state=expect_state, slots=slots, cu_seqlens=cu)
    work = _planned_work(x, state.clone(), slots, cu)
    return dict(work=work, state=state, slots=slots, expect=expect, expect_state=expect_state,
                d_v=request.param["d_v"])


# block_v vs d_v: 16 and 32 below 48, 64 is 48's padded tile, 128 above it (clamped to 64);
# for d_v = 32: 16 below, 32 equal, 64 above.
@pytest.mark.parametrize("block_v", [16, 32, 64, 128])
def test_fused_matches_recurrence(prepared, block_v):
    if prepared["d_v"] == 32 and block_v == 128:
        pytest.skip("same tile as block_v 64 at d_v 32")
    state = prepared["state"].clone()
    got = _run_fused(prepared["work"], state, KernelLaunch(block_v=block_v, num_warps=4, num_stages=2))
    torch.testing.assert_close(got, prepared["expect"], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, prepared["expect_state"], rtol=2e-5, atol=2e-5)
    untouched = _untouched(prepared["slots"])
    assert torch.equal(state[untouched], prepared["state"][untouched])


def test_fused_empty_sequence_and_bf16_pool():
    """A zero-length sequence keeps its state bit for bit; a bf16 pool is read and written in
    place (fp32 inside: only the final write rounds)."""
    lengths, slots = [65, 0, 3], torch.tensor([4, 1, 6], device=DEVICE)
    x, state, cu = make_inputs(lengths, H_k=1, H_v=2, d_v=48, device=DEVICE, seed=5)
    pool = state.to(torch.bfloat16)
    expect_pool = pool.clone()
    expect = ref.gdn_prefill(**x, state=expect_pool, slots=slots, cu_seqlens=cu)
    work = _planned_work(x, pool, slots, cu)
    got = _run_fused(work, pool, DEFAULT_STATE_OUTPUT_LAUNCH)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool.float(), expect_pool.float(), rtol=1e-2, atol=1e-2)  # one bf16 ulp
    assert torch.equal(pool[1], state[1].to(torch.bfloat16))
    assert torch.equal(pool[_untouched(slots)], state[_untouched(slots)].to(torch.bfloat16))


def test_fused_half_precision_path():
    """16-bit inputs take the tensor-core branch (operands rounded to the input dtype). fp16: the
    interpreter cannot multiply bf16; CUDA covers bf16 below."""
    x, state, cu = make_inputs([70, 5], H_k=1, H_v=2, device=DEVICE, dtype=torch.float16, seed=11)
    slots = torch.tensor([3, 8], device=DEVICE)
    expect_state = state.clone()
    expect = ref.gdn_prefill(**{n: t.float() for n, t in x.items()}, state=expect_state, slots=slots, cu_seqlens=cu)
    work = _planned_work(x, state, slots, cu)
    got = _run_fused(work, state, KernelLaunch(block_v=16, num_warps=4, num_stages=2))
    assert got.dtype == torch.float16
    assert _rel_err(got, expect) < 2e-3
    assert _rel_err(state, expect_state) < 2e-3


# Launches that compile for sm_90 at d = 128 without register spills (see the module's report).
SPILL_FREE_LAUNCHES = [DEFAULT_STATE_OUTPUT_LAUNCH, KernelLaunch(32, 8, 2), KernelLaunch(32, 8, 1),
                       KernelLaunch(16, 8, 2), KernelLaunch(16, 4, 2)]


@requires_cuda
@pytest.mark.parametrize("launch", SPILL_FREE_LAUNCHES, ids=lambda k: f"{k.block_v}.{k.num_warps}.{k.num_stages}")
def test_fused_model_shapes_bf16_cuda(launch):
    lengths = [1, 63, 64, 65, 1000, 4097]
    x, state, cu = make_inputs(lengths, H_k=16, H_v=48, d_k=128, d_v=128, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([5, 2, 7, 0, 3, 8], device="cuda")
    expect_state = state.clone()
    expect = ref.gdn_prefill(**{n: t.float() for n, t in x.items()}, state=expect_state, slots=slots, cu_seqlens=cu)
    original = state.clone()
    work = _planned_work(x, state, slots, cu)
    got = _run_fused(work, state, launch)
    torch.cuda.synchronize()
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    # The same budget as the split pipeline's bf16 test (tests/test_kernels_gdn.py).
    assert _rel_err(got, expect) < 1e-2
    assert _rel_err(state[slots], expect_state[slots]) < 5e-3
    assert torch.equal(state[_untouched(slots)], original[_untouched(slots)])
