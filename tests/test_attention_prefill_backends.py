"""Prefill attention with a selectable long-run backend (kernels/attention_prefill_backends.py).

On the CPU: the segment plan, the slicing / offset maths of a split batch (the Triton kernel in
the interpreter for the short runs, stand-ins for the long-run backends, torch's CPU SDPA for
`run_sdpa`), the host-length cache, and the fallback to Triton off CUDA — all against the fp32
reference. On a GPU: every backend at the 27B head shapes in bf16 against the reference.
"""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels.attention import prefill_backends as apb
from batchinfer.kernels.attention.prefill_backends import PrefillPolicy, Segment, attention_prefill_with, plan_segments
from batchinfer.kernels.attention.prefill_fa import FaLaunch, attention_prefill_fa
from batchinfer.kernels.ref import attention as ref_attention
from tests.conftest import interpreter_only, requires_cuda
from tests.test_kernels_attention import make_batch

# Sequences: (context, new). Long runs (≥ MIN_RUN new) among short ones, with and without a
# cached prefix, a long run first and last, two long runs side by side.
MIN_RUN = 8
CONTEXTS = [12, 5, 3, 20, 9, 8, 2, 30]
NEW = [12, 5, 3, 9, 9, 8, 1, 10]
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def reference(batch) -> torch.Tensor:
    return ref_attention.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                           batch.kv_indptr, batch.cu_seqlens, batch.scale)


def sequence_standin(calls):
    """A per-sequence backend made of the reference: one sequence as a one-sequence batch."""
    def run(q, k, v, scale, policy):
        calls.append((q.shape[0], k.shape[0]))
        idx = torch.arange(k.shape[0])
        return ref_attention.attention_prefill(q, k, v, idx, torch.tensor([0, k.shape[0]]),
                                               torch.tensor([0, q.shape[0]]), scale)
    return run


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


def test_plan_without_a_long_run_stays_on_triton():
    for backend in ("varlen", "sdpa-cudnn"):
        assert plan_segments([7, 3, 7], PrefillPolicy(backend, min_run=8)) == [Segment("triton", 0, 3)]


def test_plan_packed_backend_takes_the_whole_batch():
    assert plan_segments([3, 8, 2], PrefillPolicy("varlen", min_run=8)) == [Segment("backend", 0, 3)]


def test_plan_sequence_backend_splits_long_runs_from_runs_of_short_ones():
    plan = plan_segments(NEW, PrefillPolicy("sdpa-flash", min_run=MIN_RUN))
    assert plan == [Segment("backend", 0, 1), Segment("triton", 1, 3), Segment("backend", 3, 4),
                    Segment("backend", 4, 5), Segment("backend", 5, 6), Segment("triton", 6, 7),
                    Segment("backend", 7, 8)]


def test_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="backend 'fa9'"):
        PrefillPolicy("fa9")
    with pytest.raises(ValueError, match="prefix_mask"):
        PrefillPolicy("sdpa-flash", prefix_mask="upper")


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
                                    PrefillPolicy("sdpa-flash", min_run=MIN_RUN, prefix_mask="dense")])
def test_run_sdpa_on_cpu_matches_reference(policy):
    """torch's CPU flash SDPA behind run_sdpa: layout, GQA and both prefix masks."""
    batch = make_batch(CONTEXTS, NEW, seed=5)
    out = attention_prefill_with(policy, batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                 batch.kv_indptr, batch.cu_seqlens, batch.scale)
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


@pytest.mark.parametrize("cached,new", [(37, 29), (1, 16), (64, 1)])
def test_split_prefix_attention_is_the_lower_right_causal_attention(cached, new):
    """The cuDNN split's maths (prefix unmasked + own keys causal, merged by log-sum-exp) with the
    fp32 stand-in for each call, against the definition in fp64 over fresh random inputs, GQA 6 / 2."""
    gen = torch.Generator().manual_seed(cached * 100 + new)
    q4 = torch.randn(1, 6, new, 16, generator=gen)
    k4, v4 = torch.randn(2, 1, 2, cached + new, 16, generator=gen).unbind(0)
    scale = 16 ** -0.5 * 1.3
    out = apb.split_prefix_attention(q4, k4, v4, scale, apb.math_attend)  # [1, H, n, d]
    keys, values = k4.double().repeat_interleave(3, 1), v4.double().repeat_interleave(3, 1)
    scores = q4.double() @ keys.transpose(-1, -2) * scale
    scores = scores.masked_fill(~apb.causal_mask(new, cached + new, "cpu"), float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ values
    assert out.shape == q4.shape and not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)


def test_merge_by_lse_weights_each_part_by_its_share_of_the_mass():
    """Two key sets whose log-sum-exps differ by log 3: the merged output is ¾ / ¼ of the parts."""
    o1, o2 = torch.full((1, 1, 2, 4), 1.0), torch.full((1, 1, 2, 4), 5.0)
    lse1 = torch.tensor([[[torch.log(torch.tensor(3.0)), 0.0]]])
    lse2 = torch.zeros(1, 1, 2)
    merged, lse = apb.merge_by_lse(o1, lse1, o2, lse2)
    torch.testing.assert_close(merged[0, 0, :, 0], torch.tensor([0.75 * 1 + 0.25 * 5, 3.0]))
    torch.testing.assert_close(lse[0, 0], torch.tensor([torch.log(torch.tensor(4.0)), torch.log(torch.tensor(2.0))]))


def test_split_needs_the_cudnn_backend():
    with pytest.raises(ValueError, match="split"):
        PrefillPolicy("sdpa-flash", prefix_mask="split")
    assert apb.DEFAULT_POLICY.prefix_mask == "split"


def test_run_sdpa_split_on_cpu_matches_reference():
    """run_sdpa's split path end to end (layout in and out; the fp32 stand-in off CUDA)."""
    batch = make_batch([40], [24], heads=6, kv_heads=2, seed=31)
    ctx = batch.kv_indices[:40]
    out = apb.run_sdpa("sdpa-cudnn", batch.q, batch.k_cache[ctx], batch.v_cache[ctx], batch.scale,
                       PrefillPolicy("sdpa-cudnn", prefix_mask="split"))
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


@interpreter_only
def test_a_refused_split_is_not_tried_again_and_the_run_is_still_right(monkeypatch):
    """Where the split's op raises, the lower-right path is taken (on the CPU it too refuses, so
    the run ends on the Triton kernel) and the split is marked refused for later runs."""
    monkeypatch.setattr(apb, "_REFUSED", set())

    def refusing(*args):
        raise RuntimeError("cuDNN: no engine for this layout")

    monkeypatch.setattr(apb, "math_attend", refusing)
    batch = make_batch([20, 5, 30], [9, 5, 10], seed=32)  # long runs after a cached prefix first
    out = attention_prefill_with(PrefillPolicy("sdpa-cudnn", min_run=MIN_RUN, prefix_mask="split"), batch.q,
                                 batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.cu_seqlens,
                                 batch.scale, out=torch.full_like(batch.q, float("nan")))
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)
    assert "split" in apb._REFUSED


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_op_off_cuda_runs_triton_whatever_the_policy(dtype):
    batch = make_batch(CONTEXTS, NEW, seed=6, dtype=dtype)
    with apb.prefill_policy(PrefillPolicy("varlen", min_run=1)):  # varlen_attn has no CPU kernel
        out = apb.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                                    batch.cu_seqlens, batch.scale)
    assert apb.PREFILL_POLICY == apb.DEFAULT_POLICY
    tol = FP32_TOL if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), reference(batch).float(), **tol)


def test_host_lengths_cached_per_tensor_and_refreshed_on_rewrite():
    cache = apb._HostLengths()
    cu, indptr = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    first = cache.get(cu, indptr)
    assert first == ([0, 3, 5], [0, 4, 9])
    assert cache.get(cu, indptr) is first  # the same batch: no second read
    cu[2] = 6  # an in-place rewrite (the next step reusing the buffer)
    assert cache.get(cu, indptr) == ([0, 3, 6], [0, 4, 9])


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
def test_a_refusing_sdpa_backend_falls_back_to_triton_and_stays_off(monkeypatch):
    """The default policy is cuDNN's SDPA: where it raises (no kernel for this GPU / torch) the
    long runs go to the Triton kernel, right, and the backend is not tried again."""
    monkeypatch.setattr(apb, "_REFUSED", set())
    batch = make_batch(CONTEXTS, NEW, seed=22)
    calls = []

    def refusing(*args):
        calls.append(1)
        raise RuntimeError("No available kernel. Aborting execution.")

    for _ in range(2):
        out = attention_prefill_with(PrefillPolicy("sdpa-cudnn", min_run=MIN_RUN), batch.q, batch.k_cache,
                                     batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.cu_seqlens, batch.scale,
                                     out=torch.full_like(batch.q, float("nan")), sequence_fn=refusing)
        torch.testing.assert_close(out, reference(batch), **FP32_TOL)
    assert calls == [1] and apb._REFUSED == {"sdpa-cudnn"}


# ---------------------------------------------------------------- every backend on the GPU

GPU_CONTEXTS = [300, 2048 + 700, 64, 2048, 1100]
GPU_NEW = [300, 2048, 64, 2048, 1024]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("policy", [PrefillPolicy(b, min_run=1024) for b in apb.BACKENDS]
                         + [PrefillPolicy("sdpa-cudnn", min_run=1024, repeat_kv=True),
                            PrefillPolicy("sdpa-cudnn", min_run=1024, prefix_mask="dense"),
                            PrefillPolicy("sdpa-cudnn", min_run=1024, prefix_mask="split")], ids=str)
def test_backend_matches_reference_on_gpu(policy, monkeypatch):
    monkeypatch.setattr(apb, "_REFUSED", set())  # a refusal is reported below, not hidden by the fallback
    batch = make_batch(GPU_CONTEXTS, GPU_NEW, heads=24, kv_heads=4, d=256, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(batch.q, float("nan"))
    try:
        with apb.prefill_policy(policy):
            apb.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                  batch.kv_indptr.to(torch.int32), batch.cu_seqlens.to(torch.int32),
                                  batch.scale, out=out)
    except (RuntimeError, NotImplementedError, TypeError) as exc:  # this torch lacks the backend / case
        pytest.skip(f"{policy.backend} refused: {str(exc).splitlines()[0][:200]}")
    if policy.backend in apb._REFUSED or (policy.prefix_mask == "split" and "split" in apb._REFUSED):
        pytest.skip(f"{policy} refused on this GPU / torch (its runs fell back)")
    expected = reference(batch)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@requires_cuda
@pytest.mark.gpu
def test_fp32_on_gpu_falls_back_to_triton():
    """The fused backends take half precision only: fp32 runs the Triton kernel (ieee dots)."""
    batch = make_batch(CONTEXTS, NEW, seed=7, device="cuda")
    with apb.prefill_policy(PrefillPolicy("varlen", min_run=1)):
        out = apb.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                    batch.kv_indptr.to(torch.int32), batch.cu_seqlens.to(torch.int32), batch.scale)
    torch.testing.assert_close(out, reference(batch), rtol=1e-4, atol=1e-4)


def test_host_lengths_read_inference_tensors():
    """The engine runs under inference_mode, whose tensors have no version counter."""
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        indptr = torch.tensor([0, 5, 12], dtype=torch.int32)
    cache = apb._HostLengths()
    assert cache.get(cu, indptr) == ([0, 3, 7], [0, 5, 12])
