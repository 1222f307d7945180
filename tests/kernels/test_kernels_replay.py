"""ReplaySSM decode and fold: the torch reference against the token-by-token GDN recurrence,
and the Triton kernels against the reference (TRITON_INTERPRET=1 on CPU, tiny shapes).

Pools are built with random contents and varied cursors (empty, partial, full rings); ring
entries at or past a slot's cursor are NaN so that reading a stale entry fails the test.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from batchinfer.kernels import replay_ssm as triton_replay
from batchinfer.kernels.ref import replay as ref_replay
from batchinfer.kernels.ref.gdn import gdn_recurrent_reference
from tests.conftest import requires_cuda

IMPLS = {"ref": ref_replay, "triton": triton_replay}
# Tiny-shape kernel tests run compiled on a GPU, else in the Triton interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 throughout (the fold's tl.dot is ieee); a GPU only reorders the fp32 sums.
TOL = {"rtol": 1e-5, "atol": 1e-5} if DEVICE == "cpu" else {"rtol": 1e-4, "atol": 1e-4}


@dataclass(frozen=True)
class Shapes:
    slots: int = 7
    ring: int = 4  # L
    heads_k: int = 2
    heads_v: int = 4
    d_k: int = 16
    d_v: int = 32


def make_pools(shape: Shapes, cursors: list[int], dtype=torch.float32, device="cpu", seed=0):
    """Random ckpt + ring; G cumulative (decreasing); entries >= cursor poisoned with NaN."""
    gen = torch.Generator().manual_seed(seed)
    S, L = shape.slots, shape.ring

    def randn(*size):
        return torch.randn(*size, generator=gen)

    ckpt = randn(S, shape.heads_v, shape.d_k, shape.d_v) * 0.3
    ring_k = torch.nn.functional.normalize(randn(S, L, shape.heads_k, shape.d_k), dim=-1)
    ring_u = randn(S, L, shape.heads_v, shape.d_v) * 0.3
    ring_g = -(torch.rand(S, L, shape.heads_v, generator=gen) * 0.5).cumsum(1)
    cursor = torch.tensor(cursors, dtype=torch.int32)
    stale = torch.arange(L)[None, :] >= cursor[:, None].long()  # [S, L]
    ring_k[stale] = float("nan")
    ring_u[stale] = float("nan")
    ring_g[stale] = float("nan")
    pools = [ckpt.to(dtype), ring_k.to(dtype), ring_u.to(dtype), ring_g, cursor]
    return [p.to(device) for p in pools]


def make_step_inputs(shape: Shapes, batch: int, gen: torch.Generator, device="cpu", dtype=torch.float32):
    """q, k, v, a, b for one decode step of `batch` sequences."""
    def randn(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    return (randn(batch, shape.heads_k, shape.d_k), randn(batch, shape.heads_k, shape.d_k),
            randn(batch, shape.heads_v, shape.d_v), randn(batch, shape.heads_v), randn(batch, shape.heads_v))


def make_gate_params(shape: Shapes, device="cpu"):
    gen = torch.Generator().manual_seed(123)
    A_log = (torch.rand(shape.heads_v, generator=gen) * 2 - 1).to(device)
    dt_bias = (torch.rand(shape.heads_v, generator=gen) - 0.5).to(device)
    return A_log, dt_bias


def advance(cursor: torch.Tensor, slots: torch.Tensor, L: int) -> None:
    """What the model runner does after each ReplaySSM step."""
    cursor[slots] = cursor[slots] % L + 1


def folded_states(pools, slots) -> torch.Tensor:
    """Reference fp32 state of each slot at its cursor. → [B, H_v, d_k, d_v]."""
    return torch.stack([ref_replay.replay_state(*pools, int(s)) for s in slots])


def recurrent_step(q, k, v, a, b, A_log, dt_bias, state, slots):
    """Ground truth: one token per sequence through the fp32 GDN recurrence (kernels/ref/gdn.py)."""
    cu_seqlens = torch.arange(q.shape[0] + 1, device=q.device)
    return gdn_recurrent_reference(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens)


def test_reference_matches_recurrence_across_flushes():
    """Outputs and the state at every cursor equal the recurrence, through several full rings."""
    shape = Shapes()
    L = shape.ring
    pools = make_pools(shape, cursors=[0] * shape.slots)
    slots = torch.tensor([5, 0, 3])
    state = torch.full((shape.slots, shape.heads_v, shape.d_k, shape.d_v), float("nan"))
    state[slots] = pools[0][slots].float()
    A_log, dt_bias = make_gate_params(shape)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3 * L + 1):
        inputs = make_step_inputs(shape, len(slots), gen)
        out = ref_replay.replay_decode(*inputs, A_log, dt_bias, *pools, slots)
        advance(pools[4], slots, L)
        expected = recurrent_step(*inputs, A_log, dt_bias, state, slots)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(folded_states(pools, slots), state[slots], rtol=1e-5, atol=1e-5)


DECODE_CASES = {  # shape, StepLaunch knobs
    # C streamed in two d_k chunks; the flush folds in two chunks of d_k rows.
    "L4-dk-chunked": (Shapes(ring=4, heads_k=1, heads_v=2, d_k=32),
                      {"block_v": 16, "block_k": 16, "flush_block_k": 16}),
    "L16": (Shapes(ring=16), {"block_v": 16, "block_k": 128}),
    # L and d_v not powers of two: padded ring rows, a partial d_v block, three flush d_v blocks.
    "L5-dv48": (Shapes(ring=5, heads_k=1, heads_v=3, d_v=48), {"block_v": 32, "flush_block_v": 16}),
    # Ring-key dots computed once per key head by the flush launch (GROUP = 3 value heads read them).
    "L5-dv48-key-dots": (Shapes(ring=5, heads_k=1, heads_v=3, d_v=48),
                         {"key_dots_in_flush": True, "flush_block_v": 32}),
    # One flush program per (value head, d_v block) against one per (sequence, key head) (the
    # default): GROUP × three d_v blocks folded in turn, with and without the key dots.
    "L5-dv48-per-value-head": (Shapes(ring=5, heads_k=1, heads_v=3, d_v=48),
                               {"key_dots_in_flush": True, "flush_block_v": 16, "flush_per_key_head": False}),
    "L5-dv48-per-key-head": (Shapes(ring=5, heads_k=2, heads_v=6, d_v=48),
                             {"key_dots_in_flush": True, "flush_block_v": 16, "flush_per_key_head": True}),
    "L4-per-key-head-no-dots": (Shapes(ring=4, heads_k=2, heads_v=4, d_k=32),
                                {"key_dots_in_flush": False, "flush_block_k": 16, "flush_per_key_head": True}),
    # The persistent flush over the full rings only (its programs loop: the interpreter's grid is
    # 1-2 programs for 4+ work items), key dots in their own launch or in the step.
    "L5-dv48-persistent-flush": (Shapes(ring=5, heads_k=2, heads_v=6, d_v=48),
                                 {"key_dots_in_flush": True, "flush_persistent": True, "flush_block_v": 16}),
    "L5-dv48-persistent-flush-tiles": (Shapes(ring=5, heads_k=2, heads_v=6, d_v=48),
                                       {"key_dots_in_flush": True, "flush_persistent": True, "flush_block_v": 16,
                                        "flush_tile_items": True, "live_ring_loads": True}),
    "L4-persistent-flush-no-dots": (Shapes(ring=4, heads_k=2, heads_v=4, d_k=32),
                                    {"key_dots_in_flush": False, "flush_persistent": True, "flush_block_k": 16,
                                     "flush_programs_per_sm": 1}),
    # Only the live ring entries loaded (stale ones are NaN: a load past the cursor that leaks fails).
    "L5-dv48-live-ring-loads": (Shapes(ring=5, heads_k=2, heads_v=6, d_v=48),
                                {"key_dots_in_flush": True, "flush_persistent": True, "live_ring_loads": True}),
    "L4-live-ring-loads-dots-in-step": (Shapes(ring=4, heads_k=1, heads_v=2, d_k=32),
                                        {"key_dots_in_flush": False, "live_ring_loads": True, "block_k": 16}),
    # The CUDA-core variant of the d_k dots, with and without the flush's ring-key dots.
    "L16-fma": (Shapes(ring=16), {"tensor_cores": False, "block_v": 16}),
    "L4-fma-key-dots": (Shapes(ring=4, heads_k=1, heads_v=2, d_k=32),
                        {"tensor_cores": False, "key_dots_in_flush": True, "block_k": 16, "flush_warps": 2}),
}


@pytest.mark.parametrize("case", DECODE_CASES)
def test_triton_decode_matches_reference(case):
    """Mixed cursors (empty, partial, full), slots out of order, steps across a flush;
    several d_v blocks per head, and (first case) the C tile streamed in two d_k chunks.
    Stale ring entries are NaN: the kernel loads all L entries and must mask them itself."""
    shape, knobs = DECODE_CASES[case]
    ring = shape.ring
    L = ring
    cursors = [L, 0, 1, L - 1, 2, L, 0]
    ref_pools = make_pools(shape, cursors, device=DEVICE)
    tri_pools = [p.clone() for p in ref_pools]
    slots = torch.tensor([5, 2, 0, 3, 1], device=DEVICE)  # 5 and 0 start full, 1 empty, 3 one short of full
    A_log, dt_bias = make_gate_params(shape, DEVICE)
    gen = torch.Generator().manual_seed(2)
    n_steps = L + 1 if L <= 5 else 2  # short rings: every slot folds at least once
    for _ in range(n_steps):
        inputs = make_step_inputs(shape, len(slots), gen, DEVICE)
        poisoned = torch.full((len(slots), shape.heads_v, shape.d_v), float("nan"), device=DEVICE)
        expected = ref_replay.replay_decode(*inputs, A_log, dt_bias, *ref_pools, slots)
        out = triton_replay.replay_decode(*inputs, A_log, dt_bias, *tri_pools, slots, out=poisoned, **knobs)
        torch.testing.assert_close(out, expected, **TOL)
        for pool_ref, pool_tri in zip(ref_pools, tri_pools):  # includes untouched slots 4, 6
            torch.testing.assert_close(pool_tri, pool_ref, **TOL, equal_nan=True)
        for pools in (ref_pools, tri_pools):
            advance(pools[4], slots, L)


BF16_CASES = {  # q/k/v dtype, StepLaunch knobs
    "bf16-inputs": (torch.bfloat16, {}),
    "fp32-inputs": (torch.float32, {}),  # k, q enter the mma as high + low bf16 parts
    "fp32-inputs-key-dots": (torch.float32, {"key_dots_in_flush": True}),
    "bf16-inputs-persistent-flush": (torch.bfloat16, {"key_dots_in_flush": True, "flush_persistent": True}),
    "bf16-inputs-live-ring-loads": (torch.bfloat16, {"key_dots_in_flush": True, "flush_persistent": True,
                                                     "live_ring_loads": True}),
}


@pytest.mark.parametrize("case", BF16_CASES)
def test_triton_decode_bf16_checkpoint_matches_reference(case):
    """The production layout: bf16 checkpoint and ring. On the first step the rings that are not
    full hold the same bf16 values for both sides and all math is fp32, so fp32 outputs agree to
    ~1e-6 (fp32 k, q rounded to bf16 in the mma instead of split: ~3e-4). Later, a stored u or a
    folded C may round one bf16 ulp apart: 2e-2, as on the GPU."""
    inputs_dtype, knobs = BF16_CASES[case]
    shape = Shapes(ring=4, heads_k=1, heads_v=3, d_k=32, d_v=48)
    L = shape.ring
    ref_pools = make_pools(shape, [L, 0, 1, L - 1, 2, L, 0], dtype=torch.bfloat16, device=DEVICE)
    tri_pools = [p.clone() for p in ref_pools]
    slots = torch.tensor([5, 2, 0, 3, 1], device=DEVICE)
    not_full = torch.tensor([1, 3, 4], device=DEVICE)  # rows of `slots` whose ring is not full
    A_log, dt_bias = make_gate_params(shape, DEVICE)
    gen = torch.Generator().manual_seed(6)
    for step in range(L + 1):
        inputs = make_step_inputs(shape, len(slots), gen, DEVICE, inputs_dtype)
        poisoned = torch.full((len(slots), shape.heads_v, shape.d_v), float("nan"), device=DEVICE, dtype=inputs_dtype)
        expected = ref_replay.replay_decode(*inputs, A_log, dt_bias, *ref_pools, slots).float()
        out = triton_replay.replay_decode(*inputs, A_log, dt_bias, *tri_pools, slots, out=poisoned, **knobs).float()
        if step == 0 and inputs_dtype == torch.float32:  # (bf16 inputs: bf16 outputs, 1-ulp apart)
            torch.testing.assert_close(out[not_full], expected[not_full], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
        for pools in (ref_pools, tri_pools):
            advance(pools[4], slots, L)
    for pool_ref, pool_tri in zip(ref_pools, tri_pools):
        torch.testing.assert_close(pool_tri.float(), pool_ref.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


FOLD_CASES = {  # impl, pool dtype, tolerance of the folded checkpoint
    "ref": ("ref", torch.float32, TOL),
    "triton": ("triton", torch.float32, TOL),
    # bf16: high + low bf16 parts of the fp32 ring weights, then one rounding to bf16: half an
    # ulp on the GPU, up to a whole one (2^-7 relative) in the interpreter, which truncates.
    "triton-bf16": ("triton", torch.bfloat16, {"rtol": 2 ** -7, "atol": 1e-6}),
}


@pytest.mark.parametrize("case", FOLD_CASES)
def test_fold_copies_state_and_leaves_source_untouched(case):
    impl, dtype, tol = FOLD_CASES[case]
    shape = Shapes(d_k=32)
    L = shape.ring
    pools = make_pools(shape, cursors=[3, L, 0, 1, 2, 0, L], dtype=dtype, device=DEVICE)
    before = [p.clone() for p in pools]
    src, dst = torch.tensor([1, 4, 3], device=DEVICE), torch.tensor([5, 2, 6], device=DEVICE)
    expected = folded_states(pools, src)
    IMPLS[impl].replay_fold(*pools, src, dst)  # Triton: two chunks of 16 d_k rows per program
    torch.testing.assert_close(pools[0][dst].float(), expected, **tol)
    untouched = torch.tensor([0, 1, 3, 4], device=DEVICE)  # sources and bystanders: bit-identical
    for now, then in zip(pools, before):
        torch.testing.assert_close(now[untouched], then[untouched], rtol=0, atol=0, equal_nan=True)
    # The folded copy with cursor 0 is the same state as the source at its cursor.
    pools[4][dst] = 0
    torch.testing.assert_close(folded_states(pools, dst), expected, **tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_fold_in_place_then_continue_equals_uninterrupted(impl):
    """A flush mid-ring (as donation does) must not change what later steps compute."""
    kernels = IMPLS[impl]
    shape = Shapes()
    L = shape.ring
    straight = make_pools(shape, cursors=[0, 2, 0, 1, 0, 0, 3], device=DEVICE)
    flushed = [p.clone() for p in straight]
    slots = torch.tensor([6, 1], device=DEVICE)
    A_log, dt_bias = make_gate_params(shape, DEVICE)
    gen = torch.Generator().manual_seed(3)
    for step in range(L + 1):  # slot 6 folds in place at step 2 and on a full ring at step 3
        if step == 2:
            kernels.replay_fold(*flushed, slots, slots)
            flushed[4][slots] = 0
        inputs = make_step_inputs(shape, len(slots), gen, DEVICE)
        out_straight = kernels.replay_decode(*inputs, A_log, dt_bias, *straight, slots)
        out_flushed = kernels.replay_decode(*inputs, A_log, dt_bias, *flushed, slots)
        torch.testing.assert_close(out_flushed, out_straight, **TOL)
        advance(straight[4], slots, L)
        advance(flushed[4], slots, L)
    torch.testing.assert_close(folded_states(flushed, slots), folded_states(straight, slots), **TOL)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def run_precision_case(kernels, shape: Shapes, ckpt_dtype, steps: int, device: str, seed: int = 0):
    """`steps` ReplaySSM steps from a random state vs the fp32 recurrence.

    Returns (relative error of all outputs, relative error of the final folded state).
    """
    batch = 3
    slots = torch.tensor([2, 0, 1], device=device)
    pools = make_pools(replace(shape, slots=batch), [0] * batch, ckpt_dtype, device, seed)
    state = pools[0].float().clone()  # the recurrence starts from exactly the rounded checkpoint
    A_log, dt_bias = make_gate_params(shape, device)
    gen = torch.Generator().manual_seed(seed + 1)
    outs, expected_outs = [], []
    for _ in range(steps):
        inputs = make_step_inputs(shape, batch, gen, device)
        outs.append(kernels.replay_decode(*inputs, A_log, dt_bias, *pools, slots))
        advance(pools[4], slots, shape.ring)
        expected_outs.append(recurrent_step(*inputs, A_log, dt_bias, state, slots))
    kernels.replay_fold(*pools, slots, slots)
    return (relative_error(torch.stack(outs), torch.stack(expected_outs)),
            relative_error(pools[0][slots], state[slots]))


PRECISION_BOUNDS = [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)]


@pytest.mark.parametrize("impl,heads,device", [
    (ref_replay, dict(heads_k=1, heads_v=2, d_k=16, d_v=16), "cpu"),
    pytest.param(triton_replay, dict(heads_k=16, heads_v=48, d_k=128, d_v=128), "cuda", marks=requires_cuda),
], ids=["reference", "triton_real_shapes"])
@pytest.mark.parametrize("ring", [8, 16, 32])
@pytest.mark.parametrize("ckpt_dtype,bound", PRECISION_BOUNDS)
def test_precision_256_steps(impl, heads, device, ring, ckpt_dtype, bound):
    shape = Shapes(ring=ring, **heads)
    out_err, state_err = run_precision_case(impl, shape, ckpt_dtype, steps=256, device=device)
    assert out_err <= bound and state_err <= bound, (out_err, state_err)


@requires_cuda
@pytest.mark.parametrize("ckpt_dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference_on_cuda(ckpt_dtype):
    """Real head shapes, bf16 inputs as the model feeds them; cursors cover all ring states."""
    shape = Shapes(slots=40, ring=16, heads_k=16, heads_v=48, d_k=128, d_v=128)
    cursors = [(7 * i) % 17 for i in range(shape.slots)]  # 0..16, 16 == full
    ref_pools = make_pools(shape, cursors, ckpt_dtype, "cuda")
    tri_pools = [p.clone() for p in ref_pools]
    slots = torch.randperm(shape.slots, generator=torch.Generator().manual_seed(4))[:32].cuda()
    A_log, dt_bias = make_gate_params(shape, "cuda")
    gen = torch.Generator().manual_seed(5)
    tol = 1e-4 if ckpt_dtype == torch.float32 else 2e-2
    for _ in range(20):
        inputs = make_step_inputs(shape, len(slots), gen, "cuda", torch.bfloat16)
        expected = ref_replay.replay_decode(*inputs, A_log, dt_bias, *ref_pools, slots)
        out = triton_replay.replay_decode(*inputs, A_log, dt_bias, *tri_pools, slots)
        torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
        for pools in (ref_pools, tri_pools):
            advance(pools[4], slots, shape.ring)
    torch.testing.assert_close(folded_states(tri_pools, slots), folded_states(ref_pools, slots), rtol=tol, atol=tol)
