"""The prefill-attention backends the model's prefill was measured against (benchmarks/attention_arms/).

On the CPU: the policy's segment plan, a split batch under a per-sequence and a packed backend
(stand-ins made of the reference), torch's CPU SDPA behind `run_sdpa`, the FA2-style Triton
kernel in the interpreter, and `prefill_policy` swapping the model's op for a block — all against
the fp32 reference. On a GPU: every backend at the 27B head shapes in bf16 against the reference.
"""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import ops
from batchinfer.kernels.attention import prefill
from batchinfer.kernels.ref import attention as ref_attention
from benchmarks.attention_arms import switch
from benchmarks.attention_arms.backends import attention_prefill_with, run_sdpa
from benchmarks.attention_arms.policy import BACKENDS, DEFAULT_POLICY, PrefillPolicy, Segment, plan_segments
from benchmarks.attention_arms.prefill_fa import FaLaunch, attention_prefill_fa
from tests.conftest import interpreter_only, requires_cuda
from tests.kernels.test_attention_prefill import CONTEXTS, FP32_TOL, GPU_CONTEXTS, GPU_NEW, MIN_RUN, NEW, reference, \
    sequence_standin
from tests.kernels.test_kernels_attention import make_batch


def packed_standin(calls):
    """A packed (varlen-style) backend made of the reference over already-gathered K/V."""
    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        calls.append((max_q, max_k))
        idx = torch.arange(k.shape[0])
        return ref_attention.attention_prefill(q, k, v, idx, cu_k, cu_q, scale)
    return run


# ---------------------------------------------------------------- the plan

def test_plan_triton_policy_is_one_triton_call():
    assert plan_segments([5000, 3], PrefillPolicy("triton", min_run=8)) == [Segment("triton", 0, 2)]


def test_plan_packed_backend_takes_the_whole_batch():
    assert plan_segments([3, 8, 2], PrefillPolicy("varlen", min_run=8)) == [Segment("backend", 0, 3)]
    assert plan_segments([3, 7, 2], PrefillPolicy("varlen", min_run=8)) == [Segment("triton", 0, 3)]


def test_plan_sequence_backend_is_the_models_plan():
    assert plan_segments(NEW, PrefillPolicy("sdpa-flash", min_run=MIN_RUN)) == prefill.plan_segments(NEW, MIN_RUN)


def test_policy_rejects_unknown_names_and_split_needs_cudnn():
    with pytest.raises(ValueError, match="backend 'fa9'"):
        PrefillPolicy("fa9")
    with pytest.raises(ValueError, match="prefix_mask"):
        PrefillPolicy("sdpa-flash", prefix_mask="upper")
    with pytest.raises(ValueError, match="split"):
        PrefillPolicy("sdpa-flash", prefix_mask="split")
    assert DEFAULT_POLICY == PrefillPolicy("sdpa-cudnn", min_run=prefill.MIN_RUN, prefix_mask="split")


# ---------------------------------------------------------------- a split batch against the reference

@interpreter_only
def test_sequence_backend_split_batch_matches_reference():
    batch = make_batch(CONTEXTS, NEW, seed=3)
    calls = []
    out = torch.full_like(batch.q, float("nan"))
    attention_prefill_with(PrefillPolicy("sdpa-flash", min_run=MIN_RUN), batch.q, batch.k_cache, batch.v_cache,
                           batch.kv_indices, batch.kv_indptr, batch.cu_seqlens, batch.scale, out=out,
                           sequence_fn=sequence_standin(calls))
    assert calls == [(12, 12), (9, 20), (9, 9), (8, 8), (10, 30)]  # the long runs, each with its context
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


@interpreter_only
def test_packed_backend_matches_reference():
    batch = make_batch(CONTEXTS, NEW, seed=4)
    calls = []
    out = attention_prefill_with(PrefillPolicy("varlen", min_run=MIN_RUN), batch.q, batch.k_cache, batch.v_cache,
                                 batch.kv_indices, batch.kv_indptr, batch.cu_seqlens, batch.scale,
                                 packed_fn=packed_standin(calls))
    assert calls == [(12, 30)]
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


@interpreter_only
@pytest.mark.parametrize("policy", [PrefillPolicy("sdpa-flash", min_run=MIN_RUN),
                                    PrefillPolicy("sdpa-flash", min_run=MIN_RUN, repeat_kv=True),
                                    PrefillPolicy("sdpa-flash", min_run=MIN_RUN, prefix_mask="dense")], ids=str)
def test_run_sdpa_on_cpu_matches_reference(policy):
    """torch's CPU flash SDPA behind run_sdpa: layout, GQA and both prefix masks."""
    batch = make_batch(CONTEXTS, NEW, seed=5)
    out = attention_prefill_with(policy, batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                 batch.kv_indptr, batch.cu_seqlens, batch.scale)
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


def test_run_sdpa_split_on_cpu_matches_reference(monkeypatch):
    """run_sdpa's split path with KV heads repeated (the fp32 stand-in off CUDA)."""
    monkeypatch.setattr(prefill, "_REFUSED", set())
    batch = make_batch([40], [24], heads=6, kv_heads=2, seed=31)
    ctx = batch.kv_indices[:40]
    out = run_sdpa("sdpa-cudnn", batch.q, batch.k_cache[ctx], batch.v_cache[ctx], batch.scale,
                   PrefillPolicy("sdpa-cudnn", prefix_mask="split", repeat_kv=True))
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


# ---------------------------------------------------------------- the model's op under a policy

@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_switched_op_off_cuda_runs_triton_whatever_the_policy(dtype):
    batch = make_batch(CONTEXTS, NEW, seed=6, dtype=dtype)
    with switch.prefill_policy(PrefillPolicy("varlen", min_run=1)):  # varlen_attn has no CPU kernel
        out = switch.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                                       batch.cu_seqlens, batch.scale)
    assert switch.PREFILL_POLICY == DEFAULT_POLICY
    tol = FP32_TOL if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), reference(batch).float(), **tol)


def test_prefill_policy_points_the_models_op_here_for_the_block_only():
    assert ops.implementation("attention_prefill", True) is prefill.attention_prefill
    with switch.prefill_policy(PrefillPolicy("varlen")):
        assert ops.implementation("attention_prefill", True) is switch.attention_prefill
        assert switch.PREFILL_POLICY == PrefillPolicy("varlen")
    assert ops.implementation("attention_prefill", True) is prefill.attention_prefill
    assert switch.PREFILL_POLICY == DEFAULT_POLICY


# ---------------------------------------------------------------- the FA2-style Triton kernel

FA_CASES = [([65, 7, 64, 20], [3, 7, 64, 1]), ([63, 1, 33], [63, 1, 17]), (CONTEXTS, NEW)]


@interpreter_only
@pytest.mark.parametrize("launch", [FaLaunch(16, 16, 4, 1), FaLaunch(32, 16, 4, 1), FaLaunch(16, 32, 4, 1)], ids=str)
@pytest.mark.parametrize("case", range(len(FA_CASES)))
def test_fa_kernel_matches_reference(case, launch):
    """Tiles smaller and larger than the runs: full tiles, diagonal tiles, ragged last blocks."""
    batch = make_batch(*FA_CASES[case], seed=10 + case, heads=6, kv_heads=2)
    out = attention_prefill_fa(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                               batch.cu_seqlens, batch.scale, out=torch.full_like(batch.q, float("nan")),
                               launch=launch)
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


@interpreter_only
def test_fa_kernel_bf16_and_head_dim_not_a_power_of_two():
    batch = make_batch(CONTEXTS, NEW, seed=20, d=24, dtype=torch.bfloat16)
    out = attention_prefill_fa(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                               batch.cu_seqlens, batch.scale, launch=FaLaunch(16, 16, 4, 1))
    torch.testing.assert_close(out.float(), reference(batch).float(), rtol=2e-2, atol=2e-2)


@interpreter_only
def test_fa_policy_runs_the_whole_batch_in_the_fa_kernel():
    batch = make_batch(CONTEXTS, NEW, seed=21)
    short_calls = []
    out = attention_prefill_with(PrefillPolicy("triton-fa", min_run=MIN_RUN), batch.q, batch.k_cache,
                                 batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.cu_seqlens, batch.scale,
                                 short_fn=lambda *a, **k: short_calls.append(a))
    assert short_calls == []  # the FA kernel ran the whole batch
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


@interpreter_only
def test_a_refusing_sdpa_backend_is_recorded_by_its_name(monkeypatch):
    """The model's fallback (tests/kernels/test_attention_prefill.py) under another backend's name."""
    monkeypatch.setattr(prefill, "_REFUSED", set())
    batch = make_batch(CONTEXTS, NEW, seed=22)

    def refusing(*args):
        raise RuntimeError("No available kernel. Aborting execution.")

    out = attention_prefill_with(PrefillPolicy("sdpa-flash", min_run=MIN_RUN), batch.q, batch.k_cache, batch.v_cache,
                                 batch.kv_indices, batch.kv_indptr, batch.cu_seqlens, batch.scale, sequence_fn=refusing)
    assert prefill._REFUSED == {"sdpa-flash"}
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


# ---------------------------------------------------------------- every backend on the GPU

@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("policy", [PrefillPolicy(b, min_run=1024) for b in BACKENDS]
                         + [PrefillPolicy("sdpa-cudnn", min_run=1024, repeat_kv=True),
                            PrefillPolicy("sdpa-cudnn", min_run=1024, prefix_mask="dense"),
                            PrefillPolicy("sdpa-cudnn", min_run=1024, prefix_mask="split")], ids=str)
def test_backend_matches_reference_on_gpu(policy, monkeypatch):
    monkeypatch.setattr(prefill, "_REFUSED", set())  # a refusal is reported below, not hidden by the fallback
    batch = make_batch(GPU_CONTEXTS, GPU_NEW, heads=24, kv_heads=4, d=256, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(batch.q, float("nan"))
    try:
        with switch.prefill_policy(policy):
            ops.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                  batch.kv_indptr.to(torch.int32), batch.cu_seqlens.to(torch.int32),
                                  batch.scale, out=out)
    except (RuntimeError, NotImplementedError, TypeError) as exc:  # this torch lacks the backend / case
        pytest.skip(f"{policy.backend} refused: {str(exc).splitlines()[0][:200]}")
    if policy.backend in prefill._REFUSED or (policy.prefix_mask == "split" and "split" in prefill._REFUSED):
        pytest.skip(f"{policy} refused on this GPU / torch (its runs fell back)")
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), reference(batch).float(), atol=2e-2, rtol=2e-2)


@requires_cuda
@pytest.mark.gpu
def test_fp32_on_gpu_falls_back_to_triton_whatever_the_policy():
    """The fused backends take half precision only: fp32 runs the Triton kernel (ieee dots)."""
    batch = make_batch(CONTEXTS, NEW, seed=7, device="cuda")
    with switch.prefill_policy(PrefillPolicy("varlen", min_run=1)):
        out = ops.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                    batch.kv_indptr.to(torch.int32), batch.cu_seqlens.to(torch.int32), batch.scale)
    torch.testing.assert_close(out, reference(batch), rtol=1e-4, atol=1e-4)
