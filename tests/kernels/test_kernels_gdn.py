"""Gated DeltaNet: references vs transformers and vs the token recurrence; Triton vs references.

CPU runs the Triton kernels in the interpreter (tests/conftest.py) at tiny shapes: H_k=2, H_v=4
(so a wrong key-head mapping shows), chunk 64 with lengths 1/63/64/65/130, slots out of order,
a non-zero initial state, and slots that must stay untouched. CUDA repeats them at model shapes
in bf16 against an fp32 reference on the same bf16-rounded inputs.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from batchinfer.kernels import gdn_decode as tri_decode
from batchinfer.kernels import gdn_prefill as tri_prefill
from batchinfer.kernels._common import ChunkTables, KernelLaunch, chunk_table, chunk_table_for
from batchinfer.kernels.ref import gdn as ref
from tests.conftest import requires_cuda

# One path: the real kernels on CUDA, the Triton interpreter on CPU (tests/conftest.py). CPU tensors
# must never reach compiled Triton, so the device follows the machine, not a parameter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [1, 63, 64, 65, 130]
SLOTS = [5, 2, 7, 0, 3]
NUM_SLOTS = 9


def make_inputs(lengths, H_k=2, H_v=4, d_k=16, d_v=32, device="cpu", dtype=torch.float32, seed=0,
                correlated_keys=False):
    """Fresh random GDN inputs for packed sequences, plus a random state pool (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    k = rnd(T, H_k, d_k)
    if correlated_keys:  # nearly parallel keys: the hardest case for the triangular solve
        k = (torch.randn(1, H_k, d_k, generator=gen) + 0.05 * torch.randn(T, H_k, d_k, generator=gen)).to(device, dtype)
    inputs = dict(
        q=rnd(T, H_k, d_k), k=k, v=rnd(T, H_v, d_v),
        a=rnd(T, H_v), b=rnd(T, H_v, scale=2.0),
        A_log=(torch.rand(H_v, generator=gen) * 2 - 1.5).to(device),  # decays from mild to strong
        dt_bias=torch.randn(H_v, generator=gen).to(device),
    )
    state = (torch.randn(NUM_SLOTS, H_v, d_k, d_v, generator=gen) * 0.5).to(device)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return inputs, state, cu


def _slots(n, device):
    return torch.tensor(SLOTS[:n], device=device)


def _untouched(slots):
    return [s for s in range(NUM_SLOTS) if s not in slots.tolist()]


def _rel_err(got: torch.Tensor, expect: torch.Tensor) -> float:
    return ((got.float() - expect.float()).norm() / expect.float().norm()).item()


# ---------------------------------------------------------------- references


def test_ref_chunked_matches_recurrence():
    x, state, cu = make_inputs(LENGTHS)
    slots = _slots(len(LENGTHS), "cpu")
    expect_state = state.clone()
    expect = ref.gdn_recurrent_reference(**x, state=expect_state, slots=slots, cu_seqlens=cu)
    original = state.clone()
    got = ref.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expect_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[_untouched(slots)], original[_untouched(slots)])
    assert not torch.allclose(state[slots], original[slots])  # the states did move


def test_ref_chunked_is_stable_for_correlated_keys():
    x, state, cu = make_inputs([130, 64], correlated_keys=True, seed=3)
    slots, expect_state = _slots(2, "cpu"), state.clone()
    expect = ref.gdn_recurrent_reference(**x, state=expect_state, slots=slots, cu_seqlens=cu)
    got = ref.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expect_state, rtol=1e-4, atol=1e-4)


def test_ref_matches_transformers():
    import inspect

    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    # transformers wraps these to dispatch to fla when it is installed (and fla fails on CPU
    # tensors); unwrapping gives the pure-torch functions on any machine.
    torch_chunk_gated_delta_rule = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    torch_recurrent_gated_delta_rule = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)

    x, state, cu = make_inputs([130], seed=1)
    g, beta = ref.gdn_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    # Older transformers (5.17) expect q/k already repeated to the value heads (as the model does
    # before calling them); newer ones repeat inside. Repeating here is right for both: with equal
    # head counts the function's own repeat is skipped. Value head h reads key head h // group.
    group = x["v"].shape[1] // x["k"].shape[1]
    q_rep, k_rep = (x[name].repeat_interleave(group, dim=1) for name in ("q", "k"))
    hf_args = (q_rep[None], k_rep[None], x["v"][None], g[None], beta[None])
    for hf_rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        hf_out, hf_state = hf_rule(
            *hf_args, initial_state=state[4:5].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        ours_state = state.clone()
        ours = ref.gdn_prefill(**x, state=ours_state, slots=torch.tensor([4]), cu_seqlens=cu)
        torch.testing.assert_close(ours, hf_out[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_state[4], hf_state[0], rtol=1e-5, atol=1e-5)


def test_ref_decode_continues_prefill():
    """prefill(n) then 3 decode steps == prefill(n + 3), per sequence, with the batch out of order."""
    lengths = [5, 64, 70]
    x, state, cu = make_inputs([n + 3 for n in lengths], seed=2)
    slots = _slots(3, "cpu")
    full_state = state.clone()
    full = ref.gdn_prefill(**x, state=full_state, slots=slots, cu_seqlens=cu)

    starts = cu[:-1].tolist()
    head = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    head_cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    pick = lambda idx: {name: (t[idx] if t.dim() > 1 else t) for name, t in x.items()}  # noqa: E731
    ref.gdn_prefill(**pick(head), state=state, slots=slots, cu_seqlens=head_cu)
    for step in range(3):
        rows = torch.tensor([s + n + step for s, n in zip(starts, lengths)])
        out = ref.gdn_decode(**pick(rows), state=state, slots=slots)
        torch.testing.assert_close(out, full[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, full_state, rtol=1e-5, atol=1e-5)


def test_ref_bf16_state_pool_rounds_only_at_the_ends():
    x, state, cu = make_inputs([70, 3])
    slots = _slots(2, "cpu")
    pool = state.to(torch.bfloat16)
    fp32_pool = pool.float()
    expect = ref.gdn_prefill(**x, state=fp32_pool, slots=slots, cu_seqlens=cu)
    got = ref.gdn_prefill(**x, state=pool, slots=slots, cu_seqlens=cu)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    assert torch.equal(pool, fp32_pool.to(torch.bfloat16))


# ---------------------------------------------------------------- Triton prefill


def test_chunk_table_covers_every_token_once_without_sync():
    lengths = [1, 0, 63, 64, 65, 130]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    table = chunk_table(cu, 64, sum(lengths))
    assert table.capacity == sum(lengths) // 64 + len(lengths)  # from shapes alone
    covered = torch.zeros(sum(lengths), dtype=torch.int32)
    for start, end, seq in zip(table.start.tolist(), table.seq_end.tolist(), table.seq.tolist()):
        if end > start:
            assert cu[seq] <= start < cu[seq + 1] == end and (start - cu[seq]) % 64 == 0
            covered[start:min(start + 64, end)] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    assert table.seq_offsets.tolist() == [0, 1, 1, 2, 3, 5, 8]


def test_chunk_tables_are_built_once_per_size_for_their_own_batch():
    cu = torch.tensor([0, 5, 70, 70, 200], dtype=torch.int32)
    tables = ChunkTables(cu, 200)
    first = chunk_table_for(cu, 64, 200, tables)
    assert chunk_table_for(cu, 64, 200, tables) is first  # reused, not rebuilt
    fresh = chunk_table(cu, 64, 200)
    for name in ("start", "seq_end", "seq", "seq_offsets"):
        assert torch.equal(getattr(first, name), getattr(fresh, name)), name
    assert tables.get(16) is not first and tables.get(16).capacity == 200 // 16 + 4
    with pytest.raises(ValueError, match="another batch"):
        chunk_table_for(cu.clone(), 64, 200, tables)  # equal values, another tensor: refused
    with pytest.raises(ValueError, match="another batch"):
        chunk_table_for(cu, 64, 199, tables)


@pytest.mark.slow
def test_triton_prefill_with_shared_chunk_tables_matches_its_own():
    """Two layers' prefills sharing one ChunkTables give what each gives with its own table."""
    x, state, cu = make_inputs([65, 1, 64], device=DEVICE, seed=29)
    slots = _slots(3, DEVICE)
    tables = ChunkTables(cu, int(cu[-1]))
    own_state, shared_state = state.clone(), state.clone()
    for _ in range(2):
        own = tri_prefill.gdn_prefill(**x, state=own_state, slots=slots, cu_seqlens=cu)
        shared = tri_prefill.gdn_prefill(**x, state=shared_state, slots=slots, cu_seqlens=cu, chunk_tables=tables)
        assert torch.equal(own, shared) and torch.equal(own_state, shared_state)
    assert list(tables._tables) == [64]


def test_triton_prefill_matches_reference():
    x, state, cu = make_inputs(LENGTHS, device=DEVICE)
    slots = _slots(len(LENGTHS), DEVICE)
    expect_state, original = state.clone(), state.clone()
    expect = ref.gdn_recurrent_reference(**x, state=expect_state, slots=slots, cu_seqlens=cu)
    got = tri_prefill.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu)
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, expect_state, rtol=2e-5, atol=2e-5)
    assert torch.equal(state[_untouched(slots)], original[_untouched(slots)])


def test_triton_prefill_strided_views_empty_sequence_bf16_pool():
    """q|k|v as column views of one conv output (as the model passes them), a zero-length
    sequence (state must come back unchanged), correlated keys, and a bf16 state pool."""
    lengths = [65, 0, 3]
    x, state, cu = make_inputs(lengths, H_k=1, H_v=2, device=DEVICE, seed=5, correlated_keys=True)
    T = sum(lengths)
    packed = torch.cat([x["q"].reshape(T, -1), x["k"].reshape(T, -1), x["v"].reshape(T, -1)], dim=1)
    views = dict(x, q=packed[:, :16].view(T, 1, 16), k=packed[:, 16:32].view(T, 1, 16), v=packed[:, 32:].view(T, 2, 32))
    assert not views["q"].is_contiguous()
    slots = _slots(3, DEVICE)
    pool = state.to(torch.bfloat16)
    expect_pool = pool.clone()
    expect = ref.gdn_prefill(**x, state=expect_pool, slots=slots, cu_seqlens=cu)
    got = tri_prefill.gdn_prefill(**views, state=pool, slots=slots, cu_seqlens=cu)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool.float(), expect_pool.float(), rtol=1e-2, atol=1e-2)  # one bf16 ulp
    assert torch.equal(pool[slots[1]], state[slots[1]].to(torch.bfloat16))


@pytest.mark.parametrize("correlated_keys", [False, True], ids=["random_keys", "correlated_keys"])
def test_triton_prefill_half_precision_path(correlated_keys):
    """16-bit inputs take the tensor-core path (operands, M⁻¹·diag(beta) and the other
    intermediates in the input dtype), from strided q|k|v views. fp16 here because the interpreter
    cannot multiply bf16; CUDA covers bf16 at model shapes. Correlated keys: the WY kernel's
    triangular inverse must stay stable with 16-bit operands."""
    lengths = [70, 5]
    x, state, cu = make_inputs(lengths, H_k=1, H_v=2, device=DEVICE, dtype=torch.float16, seed=11,
                               correlated_keys=correlated_keys)
    T = sum(lengths)
    packed = torch.cat([x["q"].reshape(T, -1), x["k"].reshape(T, -1), x["v"].reshape(T, -1)], dim=1)
    views = dict(x, q=packed[:, :16].view(T, 1, 16), k=packed[:, 16:32].view(T, 1, 16), v=packed[:, 32:].view(T, 2, 32))
    slots = _slots(2, DEVICE)
    expect_state = state.clone()
    expect = ref.gdn_prefill(**{n: t.float() for n, t in x.items()}, state=expect_state, slots=slots, cu_seqlens=cu)
    got = tri_prefill.gdn_prefill(**views, state=state, slots=slots, cu_seqlens=cu)
    assert got.dtype == torch.float16
    assert _rel_err(got, expect) < 2e-3
    assert _rel_err(state, expect_state) < 2e-3


# Per-stage launch mixes: block_v differing between stages (larger, smaller, and wider than d_v),
# and the warps/stages the H200 sweep picked. The interpreter checks addressing and masks for
# every block_v mix; CUDA (test_triton_prefill_launches_at_model_shapes_cuda) also compiles each knob set.
GOOD_ON_H200 = [
    tri_prefill.DEFAULT_LAUNCH,
    # What the default runs for a few long sequences (fewer state-pass programs than SMs).
    dataclasses.replace(tri_prefill.DEFAULT_LAUNCH, state_pass=tri_prefill.DEFAULT_LAUNCH.state_pass_few_programs),
    # The previous defaults, and block_v both wider and narrower than d_v.
    tri_prefill.PrefillLaunch(wy=KernelLaunch(32, 8, 1), state_pass=KernelLaunch(32, 8, 2),
                              output=KernelLaunch(64, 8, 2)),
    tri_prefill.PrefillLaunch(wy=KernelLaunch(128, 2, 2), state_pass=KernelLaunch(16, 4, 2),
                              output=KernelLaunch(32, 4, 3)),
]
# WY at 4 warps (its default is 1) followed by the state pass and a 3-stage output kernel: a WY
# kernel that staged its operands through shared memory faulted on this mix, and the error only
# surfaced at the next launch, so the mix stays a CUDA test of its own.
WY_FOUR_WARPS_MIX = tri_prefill.PrefillLaunch(wy=KernelLaunch(32, 4, 1), state_pass=KernelLaunch(64, 4, 2),
                                                      output=KernelLaunch(128, 4, 3))
MIXED_LAUNCHES = GOOD_ON_H200 + [WY_FOUR_WARPS_MIX]
# State-pass launches at the model's shapes: both key-part layouts at the block_v / warps / stages
# the sweeps try.
STATE_VARIANTS_ON_CUDA = [
    dataclasses.replace(tri_prefill.DEFAULT_LAUNCH, state_pass=tri_prefill.StatePassLaunch(*knobs, key_parts=parts))
    for knobs, parts in [((64, 4, 2), 2), ((64, 8, 2), 2), ((32, 4, 3), 1), ((32, 4, 2), 2), ((16, 4, 2), 1),
                         ((64, 8, 2), 1)]
]


def test_state_pass_launch_by_program_count():
    """Fewer state-pass programs than SMs at the default block_v: the narrower launch."""
    launch = tri_prefill.DEFAULT_LAUNCH
    programs = 48 * (128 // launch.state_pass.block_v)  # per sequence, Qwen3.5-27B's 48 heads × d_v 128
    assert launch.state_pass_for(1, 48, 128, sm_count=programs + 1) is launch.state_pass_few_programs
    assert launch.state_pass_for(1, 48, 128, sm_count=programs) is launch.state_pass
    assert launch.state_pass_for(8, 48, 128, sm_count=132) is launch.state_pass
    never = dataclasses.replace(launch, state_pass_few_programs=None)
    assert never.state_pass_for(1, 1, 16, sm_count=132) is launch.state_pass


def _launch_id(launch) -> str:
    return "-".join(f"{k.block_v}.{k.num_warps}.{k.num_stages}" for k in (launch.wy, launch.state_pass, launch.output))


@pytest.mark.slow
@pytest.mark.parametrize("launch", MIXED_LAUNCHES, ids=_launch_id)
def test_triton_prefill_mixed_launches(launch):
    """d_v = 48: not a power of two, so every block_v leaves a masked tail or exceeds d_v."""
    x, state, cu = make_inputs([65, 1, 64], d_v=48, device=DEVICE, seed=13)
    slots = _slots(3, DEVICE)
    expect_state, original = state.clone(), state.clone()
    expect = ref.gdn_recurrent_reference(**x, state=expect_state, slots=slots, cu_seqlens=cu)
    got = tri_prefill.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu, launch=launch)
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, expect_state, rtol=2e-5, atol=2e-5)
    assert torch.equal(state[_untouched(slots)], original[_untouched(slots)])


# State-pass layouts (kernels/gdn_prefill/state_pass.py): one and two d_k parts, at block_v 32 (d_v =
# 48 leaves a masked tail). key_parts=2 needs d_k ≥ 32, so these run at d_k = 32.
STATE_VARIANTS = [tri_prefill.StatePassLaunch(32, 4, 2, key_parts=parts) for parts in (1, 2)]
PLAN_INPUTS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "slots", "cu", "chunks")


def _poisoned(work: tri_prefill.PrefillWork) -> tri_prefill.PrefillWork:
    """The plan with every buffer the kernels write (scratch and output) NaN-filled, so that an
    element a kernel fails to write shows up as NaN downstream."""
    scratch = {f.name: torch.full_like(getattr(work, f.name), float("nan"))
               for f in dataclasses.fields(work) if f.name not in PLAN_INPUTS}
    return dataclasses.replace(work, **scratch)


@pytest.fixture(scope="module")
def planned_through_wy():
    """Packed sequences with an empty one, planned and run up to the state pass (once per module:
    the interpreter is slow); each variant test then runs its own state pass and outputs."""
    lengths = [65, 1, 0, 64, 3]
    x, state, cu = make_inputs(lengths, d_k=32, d_v=48, device=DEVICE, seed=17)
    slots = _slots(len(lengths), DEVICE)
    expect_state = state.clone()
    expect = ref.gdn_recurrent_reference(**x, state=expect_state, slots=slots, cu_seqlens=cu)
    work = _poisoned(tri_prefill.plan_prefill(**x, state=state.clone(), slots=slots, cu_seqlens=cu))
    tri_prefill.run_wy(work, tri_prefill.DEFAULT_LAUNCH.wy)
    return work, state, expect, expect_state


def _variant_id(launch) -> str:
    return f"parts{launch.key_parts}"


@pytest.mark.parametrize("variant", STATE_VARIANTS, ids=_variant_id)
def test_triton_state_pass_variants(planned_through_wy, variant):
    work, state0, expect, expect_state = planned_through_wy
    fresh = _poisoned(work)
    work = dataclasses.replace(work, state=state0.clone(), v_new=fresh.v_new, q_states=fresh.q_states,
                               out=fresh.out)
    tri_prefill.run_state_pass(work, variant)
    tri_prefill.run_output(work, tri_prefill.DEFAULT_LAUNCH.output)
    torch.testing.assert_close(work.out, expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(work.state, expect_state, rtol=2e-5, atol=2e-5)
    untouched = _untouched(work.slots)
    assert torch.equal(work.state[untouched], state0[untouched])


def test_triton_prefill_writes_every_output_element():
    """The whole op on NaN-poisoned buffers: any output element or intermediate the kernels leave
    unwritten (and a later stage reads) turns into NaN."""
    x, state, cu = make_inputs([63, 64, 1, 65], device=DEVICE, seed=19)
    slots = _slots(4, DEVICE)
    expect_state = state.clone()
    expect = ref.gdn_recurrent_reference(**x, state=expect_state, slots=slots, cu_seqlens=cu)
    got = tri_prefill.run_prefill(_poisoned(tri_prefill.plan_prefill(**x, state=state, slots=slots, cu_seqlens=cu)))
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, expect_state, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pieces", [2, 5])
def test_triton_prefill_in_pieces_matches_reference(pieces):
    """The chunk table cut into pieces run one after the other (what the overlapped GPU path runs
    on two streams): cuts fall inside sequences (state carried through the pool), between them and
    next to an empty one, on NaN-poisoned buffers. Lengths 130 / 0 / 65 / 200 make 9 used chunks."""
    x, state, cu = make_inputs([130, 0, 65, 200], device=DEVICE, seed=23)
    slots = _slots(4, DEVICE)
    original = state.clone()
    expect_state = state.clone()
    expect = ref.gdn_recurrent_reference(**x, state=expect_state, slots=slots, cu_seqlens=cu)
    work = _poisoned(tri_prefill.plan_prefill(**x, state=state, slots=slots, cu_seqlens=cu))
    assert len(tri_prefill.piece_bounds(work.chunks.capacity, pieces)) == pieces
    got = tri_prefill.run_prefill(work, pieces=pieces)
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, expect_state, rtol=2e-5, atol=2e-5)
    assert torch.equal(state[slots[1]], original[slots[1]])  # the empty sequence's state


@pytest.mark.slow
def test_triton_prefill_in_pieces_keeps_a_bf16_pool_state_in_fp32():
    """With a 16-bit pool the pieces carry the state in fp32 between cuts: the same outputs and
    final bf16 state as the whole table in one go (the state rounded once, at the end)."""
    x, state, cu = make_inputs([200, 65], device=DEVICE, seed=31)
    slots = _slots(2, DEVICE)
    whole_pool, pieces_pool = state.to(torch.bfloat16), state.to(torch.bfloat16)
    whole = tri_prefill.run_prefill(tri_prefill.plan_prefill(**x, state=whole_pool, slots=slots, cu_seqlens=cu),
                                    pieces=1)
    pieces = tri_prefill.run_prefill(tri_prefill.plan_prefill(**x, state=pieces_pool, slots=slots, cu_seqlens=cu),
                                     pieces=3)
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-6)  # a bf16 round at a cut: ~1e-3
    # One bf16 ulp: the interpreter's fp32 -> bf16 store does not round as torch's .to() does.
    torch.testing.assert_close(pieces_pool.float(), whole_pool.float(), rtol=1e-2, atol=1e-2)


def test_pieces_only_for_few_programs_and_long_tables():
    launch = tri_prefill.DEFAULT_LAUNCH  # 4 pieces of >= 128 chunks, with the few-programs pass
    assert launch.pieces_for(1, 48, 128, sm_count=132, num_chunks=513) == 4
    assert launch.pieces_for(1, 48, 128, sm_count=132, num_chunks=257) == 2
    assert launch.pieces_for(1, 48, 128, sm_count=132, num_chunks=129) == 1
    assert launch.pieces_for(2, 48, 128, sm_count=132, num_chunks=514) == 1  # 192 programs: enough


def test_piece_bounds_cover_the_table_once():
    assert tri_prefill.piece_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert tri_prefill.piece_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]  # never an empty piece
    assert tri_prefill.piece_bounds(7, 1) == [(0, 7)]


def _check_launches_at_model_shapes(launches, repeats: int = 3) -> None:
    """CUDA worker (run in a child process: an illegal access is sticky and would fail every later
    test). Prints each launch before running it, so the parent can name the one that crashed."""
    lengths = [63, 65, 1000] + [2048] * 6
    x, state0, cu = make_inputs(lengths, H_k=16, H_v=48, d_k=128, d_v=128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(NUM_SLOTS, device="cuda")[: len(lengths)]
    expect_state = state0.clone()
    expect = ref.gdn_prefill(**{n: t.float() for n, t in x.items()}, state=expect_state, slots=slots, cu_seqlens=cu)
    for launch in launches:
        print(f"RUNNING {launch}", flush=True)
        for _ in range(repeats):  # some compiled faults are intermittent
            state = state0.clone()
            got = tri_prefill.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu, launch=launch)
            torch.cuda.synchronize()
            err, state_err = _rel_err(got, expect), _rel_err(state[slots], expect_state[slots])
            assert err < 1e-2 and state_err < 5e-3, f"{launch}: rel err {err:.1e} / state {state_err:.1e}"
        print(f"OK {_launch_id(launch)}", flush=True)


def _run_launches_in_child(which: str, expected: int) -> None:
    child = subprocess.run([sys.executable, "-m", "tests.kernels.test_kernels_gdn", which],
                           capture_output=True, text=True, timeout=600)
    started = [line for line in child.stdout.splitlines() if line.startswith("RUNNING")]
    assert child.returncode == 0, (
        f"crashed in {started[-1] if started else 'setup'}\n{child.stdout[-2000:]}\n{child.stderr[-3000:]}")
    assert len(started) == expected


@requires_cuda
def test_triton_prefill_launches_at_model_shapes_cuda():
    _run_launches_in_child("good-launches", len(GOOD_ON_H200))


@requires_cuda
def test_triton_prefill_state_variants_at_model_shapes_cuda():
    _run_launches_in_child("state-variants", len(STATE_VARIANTS_ON_CUDA))


@requires_cuda
def test_triton_prefill_wy_at_four_warps_then_state_pass_cuda():
    """WY_FOUR_WARPS_MIX at the model's shapes: every stage correct, no illegal memory access."""
    _run_launches_in_child("wy-four-warps-mix", 1)


# ---------------------------------------------------------------- Triton decode


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_matches_reference(pool_dtype):
    x, state, _ = make_inputs([1] * 5, d_v=48, device=DEVICE, seed=7)  # d_v not a power of two
    slots = _slots(5, DEVICE)
    pool = state.to(pool_dtype)
    expect_pool, original = pool.clone(), pool.clone()
    # A bf16 pool may round one ulp differently (Triton's exp vs torch's), and the next step sees it.
    tol = dict(rtol=2e-5, atol=2e-5) if pool_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for step in range(2):
        step_inputs, _, _ = make_inputs([1] * 5, d_v=48, device=DEVICE, seed=10 + step)
        step_inputs.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
        expect = ref.gdn_decode(**step_inputs, state=expect_pool, slots=slots)
        got = tri_decode.gdn_decode(**step_inputs, state=pool, slots=slots)
        torch.testing.assert_close(got, expect, **tol)
        torch.testing.assert_close(pool.float(), expect_pool.float(), **tol)
    assert torch.equal(pool[_untouched(slots)], original[_untouched(slots)])


# ---------------------------------------------------------------- CUDA, model shapes


@requires_cuda
def test_triton_prefill_model_shapes_bf16():
    lengths = [1, 63, 64, 65, 1000, 4097]
    x, state, cu = make_inputs(lengths, H_k=16, H_v=48, d_k=128, d_v=128, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([5, 2, 7, 0, 3, 8], device="cuda")
    expect_state = state.clone()
    x32 = {name: t.float() for name, t in x.items()}  # fp32 reference on the same bf16-rounded inputs
    expect = ref.gdn_prefill(**x32, state=expect_state, slots=slots, cu_seqlens=cu)
    got = tri_prefill.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu)
    assert got.dtype == torch.bfloat16
    # Rounding the output to bf16 alone costs ~2e-3 (RMS, relative); the bf16 matmul operands
    # (M⁻¹·diag(beta), new values, q·S0 rows) add about as much again.
    assert _rel_err(got, expect) < 1e-2
    assert _rel_err(state[slots], expect_state[slots]) < 5e-3


@requires_cuda
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_one_long_sequence_overlaps_pieces_cuda(pool_dtype):
    """One long sequence at model shapes: the default runs it in overlapped pieces on two streams.
    Against the fp32 reference, and against the same plan in one piece: identical outputs (the
    same kernels on the same rows; only the cuts and the streams differ)."""
    x, state, cu = make_inputs([16447], H_k=16, H_v=48, d_k=128, d_v=128, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([4], device="cuda")
    launch, sm_count = tri_prefill.DEFAULT_LAUNCH, torch.cuda.get_device_properties(0).multi_processor_count
    assert launch.pieces_for(1, 48, 128, sm_count, num_chunks=16447 // 64 + 1) == 2
    pool = state.to(pool_dtype)
    expect_state, whole_pool = state.clone(), pool.clone()
    expect = ref.gdn_prefill(**{n: t.float() for n, t in x.items()}, state=expect_state, slots=slots, cu_seqlens=cu)
    got = tri_prefill.gdn_prefill(**x, state=pool, slots=slots, cu_seqlens=cu)
    whole = tri_prefill.run_prefill(tri_prefill.plan_prefill(**x, state=whole_pool, slots=slots, cu_seqlens=cu),
                                    pieces=1)
    torch.cuda.synchronize()
    assert _rel_err(got, expect) < 1e-2 and _rel_err(pool[slots], expect_state[slots]) < 5e-3
    assert torch.equal(got, whole)
    torch.testing.assert_close(pool.float(), whole_pool.float(), rtol=1e-2 if pool_dtype != torch.float32 else 0,
                               atol=0)


@requires_cuda
def test_triton_decode_model_shapes_bf16():
    x, state, _ = make_inputs([1] * 130, H_k=16, H_v=48, d_k=128, d_v=128, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(200, 48, 128, 128, device="cuda") * 0.5
    slots = torch.randperm(200, device="cuda")[:130]
    expect_state = state.clone()
    expect = ref.gdn_decode(**{n: t.float() for n, t in x.items()}, state=expect_state, slots=slots)
    got = tri_decode.gdn_decode(**x, state=state, slots=slots)
    assert _rel_err(got, expect) < 5e-3
    assert _rel_err(state, expect_state) < 1e-5


if __name__ == "__main__" and sys.argv[1:] == ["good-launches"]:
    _check_launches_at_model_shapes(GOOD_ON_H200)
elif __name__ == "__main__" and sys.argv[1:] == ["state-variants"]:
    _check_launches_at_model_shapes(STATE_VARIANTS_ON_CUDA)
elif __name__ == "__main__" and sys.argv[1:] == ["wy-four-warps-mix"]:
    _check_launches_at_model_shapes([WY_FOUR_WARPS_MIX])
