"""The model's prefill attention (kernels/attention/prefill.py): cuDNN for long runs, Triton for the rest.

On the CPU: the segment plan, the slicing / offset maths of a split batch (the Triton kernel in
the interpreter for the short runs, a stand-in for cuDNN), the split of a run after a cached
prefix (its fp32 stand-in `math_attend`), the fallbacks when cuDNN refuses, the host-length cache
and the Triton kernel off CUDA — all against the fp32 reference. On a GPU: the op at the 27B head
shapes in bf16 against the reference. The comparison backends: tests/kernels/test_attention_prefill_backends.py.
"""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import ops
from batchinfer.kernels.attention import prefill
from batchinfer.kernels.attention.prefill import Segment, attention_prefill_with, plan_segments
from batchinfer.kernels.ref import attention as ref_attention
from tests.conftest import interpreter_only, requires_cuda
from tests.kernels.test_kernels_attention import make_batch

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
    def run(q, k, v, scale, *policy):
        calls.append((q.shape[0], k.shape[0]))
        idx = torch.arange(k.shape[0])
        return ref_attention.attention_prefill(q, k, v, idx, torch.tensor([0, k.shape[0]]),
                                               torch.tensor([0, q.shape[0]]), scale)
    return run


def test_the_model_dispatches_prefill_to_this_module():
    assert ops.OPS["attention_prefill"][0] == "batchinfer.kernels.attention.prefill"


# ---------------------------------------------------------------- the plan

def test_plan_without_a_long_run_stays_on_triton():
    assert plan_segments([7, 3, 7], min_run=8) == [Segment("triton", 0, 3)]
    assert plan_segments([1000, 3]) == [Segment("triton", 0, 2)]  # MIN_RUN by default


def test_plan_splits_long_runs_from_runs_of_short_ones():
    assert plan_segments(NEW, MIN_RUN) == [Segment("backend", 0, 1), Segment("triton", 1, 3),
                                           Segment("backend", 3, 4), Segment("backend", 4, 5),
                                           Segment("backend", 5, 6), Segment("triton", 6, 7),
                                           Segment("backend", 7, 8)]


# ---------------------------------------------------------------- a split batch against the reference

@interpreter_only
def test_split_batch_matches_reference():
    batch = make_batch(CONTEXTS, NEW, seed=3)
    calls = []
    out = torch.full_like(batch.q, float("nan"))
    attention_prefill_with(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                           batch.cu_seqlens, batch.scale, out=out, min_run=MIN_RUN, sequence_fn=sequence_standin(calls))
    assert calls == [(12, 12), (9, 20), (9, 9), (8, 8), (10, 30)]  # the long runs, each with its context
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


@pytest.mark.parametrize("cached,new", [(37, 29), (1, 16), (64, 1)])
def test_split_prefix_attention_is_the_lower_right_causal_attention(cached, new):
    """The cuDNN split's maths (prefix unmasked + own keys causal, merged by log-sum-exp) with the
    fp32 stand-in for each call, against the definition in fp64 over fresh random inputs, GQA 6 / 2."""
    gen = torch.Generator().manual_seed(cached * 100 + new)
    q4 = torch.randn(1, 6, new, 16, generator=gen)
    k4, v4 = torch.randn(2, 1, 2, cached + new, 16, generator=gen).unbind(0)
    scale = 16 ** -0.5 * 1.3
    out = prefill.split_prefix_attention(q4, k4, v4, scale, prefill.math_attend)  # [1, H, n, d]
    keys, values = k4.double().repeat_interleave(3, 1), v4.double().repeat_interleave(3, 1)
    scores = q4.double() @ keys.transpose(-1, -2) * scale
    visible = torch.ones(new, cached + new, dtype=torch.bool).tril(cached)  # query j sees keys ..= cached + j
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ values
    assert out.shape == q4.shape and not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)


def test_merge_by_lse_weights_each_part_by_its_share_of_the_mass():
    """Two key sets whose log-sum-exps differ by log 3: the merged output is ¾ / ¼ of the parts."""
    o1, o2 = torch.full((1, 1, 2, 4), 1.0), torch.full((1, 1, 2, 4), 5.0)
    lse1 = torch.tensor([[[torch.log(torch.tensor(3.0)), 0.0]]])
    lse2 = torch.zeros(1, 1, 2)
    merged, lse = prefill.merge_by_lse(o1, lse1, o2, lse2)
    torch.testing.assert_close(merged[0, 0, :, 0], torch.tensor([0.75 * 1 + 0.25 * 5, 3.0]))
    torch.testing.assert_close(lse[0, 0], torch.tensor([torch.log(torch.tensor(4.0)), torch.log(torch.tensor(2.0))]))


def test_run_cudnn_split_on_cpu_matches_reference(monkeypatch):
    """run_cudnn's split path end to end (layout in and out; the fp32 stand-in off CUDA)."""
    monkeypatch.setattr(prefill, "_REFUSED", set())
    batch = make_batch([40], [24], heads=6, kv_heads=2, seed=31)
    ctx = batch.kv_indices[:40]
    out = prefill.run_cudnn(batch.q, batch.k_cache[ctx], batch.v_cache[ctx], batch.scale)
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)


@interpreter_only
def test_a_refused_split_is_not_tried_again_and_the_run_is_still_right(monkeypatch):
    """Where the split's op raises, the lower-right path is taken (on the CPU it too refuses, so
    the run ends on the Triton kernel) and the split is marked refused for later runs."""
    monkeypatch.setattr(prefill, "_REFUSED", set())

    def refusing(*args):
        raise RuntimeError("cuDNN: no engine for this layout")

    monkeypatch.setattr(prefill, "math_attend", refusing)
    batch = make_batch([20, 5, 30], [9, 5, 10], seed=32)  # long runs after a cached prefix first
    out = attention_prefill_with(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                                 batch.cu_seqlens, batch.scale, out=torch.full_like(batch.q, float("nan")),
                                 min_run=MIN_RUN)
    torch.testing.assert_close(out, reference(batch), **FP32_TOL)
    assert "split" in prefill._REFUSED


@interpreter_only
def test_a_refusing_cudnn_falls_back_to_triton_and_stays_off(monkeypatch):
    """Where cuDNN's SDPA raises (no kernel for this GPU / torch) the long runs go to the Triton
    kernel, right, and cuDNN is not tried again."""
    monkeypatch.setattr(prefill, "_REFUSED", set())
    batch = make_batch(CONTEXTS, NEW, seed=22)
    calls = []

    def refusing(*args):
        calls.append(1)
        raise RuntimeError("No available kernel. Aborting execution.")

    for _ in range(2):
        out = attention_prefill_with(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                                     batch.cu_seqlens, batch.scale, out=torch.full_like(batch.q, float("nan")),
                                     min_run=MIN_RUN, sequence_fn=refusing)
        torch.testing.assert_close(out, reference(batch), **FP32_TOL)
    assert calls == [1] and prefill._REFUSED == {"sdpa-cudnn"}


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_op_off_cuda_runs_triton(dtype, monkeypatch):
    def no_long_runs(*args):
        raise AssertionError("off CUDA every run is the Triton kernel's")

    monkeypatch.setattr(prefill, "run_cudnn", no_long_runs)
    batch = make_batch([1100, 5], [1030, 5], heads=2, kv_heads=1, seed=6, dtype=dtype)  # one run past MIN_RUN
    out = prefill.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                                    batch.cu_seqlens, batch.scale)
    tol = FP32_TOL if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), reference(batch).float(), **tol)


# ---------------------------------------------------------------- host lengths

def test_host_lengths_cached_per_tensor_and_refreshed_on_rewrite():
    cache = prefill._HostLengths()
    cu, indptr = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    first = cache.get(cu, indptr)
    assert first == ([0, 3, 5], [0, 4, 9])
    assert cache.get(cu, indptr) is first  # the same batch: no second read
    cu[2] = 6  # an in-place rewrite (the next step reusing the buffer)
    assert cache.get(cu, indptr) == ([0, 3, 6], [0, 4, 9])


def test_host_lengths_read_inference_tensors():
    """The engine runs under inference_mode, whose tensors have no version counter."""
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        indptr = torch.tensor([0, 5, 12], dtype=torch.int32)
    cache = prefill._HostLengths()
    assert cache.get(cu, indptr) == ([0, 3, 7], [0, 5, 12])


# ---------------------------------------------------------------- the op on the GPU

GPU_CONTEXTS = [300, 2048 + 700, 64, 2048, 1100]
GPU_NEW = [300, 2048, 64, 2048, 1024]


@requires_cuda
@pytest.mark.gpu
def test_op_matches_reference_on_gpu(monkeypatch):
    monkeypatch.setattr(prefill, "_REFUSED", set())  # a refusal is reported below, not hidden by the fallback
    batch = make_batch(GPU_CONTEXTS, GPU_NEW, heads=24, kv_heads=4, d=256, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(batch.q, float("nan"))
    prefill.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                              batch.kv_indptr.to(torch.int32), batch.cu_seqlens.to(torch.int32), batch.scale, out=out)
    if prefill._REFUSED:
        pytest.skip(f"{sorted(prefill._REFUSED)} refused on this GPU / torch (its runs fell back)")
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), reference(batch).float(), atol=2e-2, rtol=2e-2)


@requires_cuda
@pytest.mark.gpu
def test_fp32_on_gpu_falls_back_to_triton():
    """cuDNN takes half precision only: fp32 runs the Triton kernel (ieee dots)."""
    batch = make_batch([1100, 5], [1030, 5], seed=7, device="cuda")
    out = prefill.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                    batch.kv_indptr.to(torch.int32), batch.cu_seqlens.to(torch.int32), batch.scale)
    torch.testing.assert_close(out, reference(batch), rtol=1e-4, atol=1e-4)
