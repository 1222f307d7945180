"""Attention over an FP8 (e4m3) KV pool: the store saturates instead of overflowing to NaN, and
the Triton kernels (interpreter on the CPU) read the pool widened to the queries' dtype, against
the fp32 reference over the same pool. Unused pool rows are NaN (FP8 keeps it), outputs
NaN-poisoned before the kernels write."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batchinfer.kernels import attention as triton_attention
from batchinfer.kernels.attention.attention import _default_decode_tile
from batchinfer.kernels.attention.prefill import attention_prefill_with
from batchinfer.kernels.ref import attention as ref_attention
from tests.conftest import requires_cuda
from tests.kernels.test_attention_prefill import CONTEXTS, GPU_CONTEXTS, GPU_NEW, MIN_RUN, NEW, sequence_standin
from tests.kernels.test_kernels_attention import DEVICE, TOL, make_batch, make_shared_batch

FP8 = torch.float8_e4m3fn


def fp8_pools(batch):
    """The batch with its pools stored in FP8 (the values in e4m3's range, NaN rows kept)."""
    return replace(batch, k_cache=ref_attention.to_pool_dtype(batch.k_cache * 3, FP8),
                   v_cache=ref_attention.to_pool_dtype(batch.v_cache * 3, FP8))


def test_the_pool_keeps_nan_rows_and_the_values_it_can_hold():
    batch = fp8_pools(make_batch([9, 4], [9, 2], seed=1))
    used = torch.zeros(batch.k_cache.shape[0], dtype=torch.bool)
    used[batch.kv_indices] = True
    assert batch.k_cache.dtype == FP8
    assert torch.isnan(batch.k_cache[~used].float()).all() and not torch.isnan(batch.k_cache[used].float()).any()


@pytest.mark.parametrize("impl", [ref_attention, triton_attention], ids=["ref", "triton"])
def test_store_into_an_fp8_pool_rounds_saturates_and_writes_only_its_slots(impl):
    gen = torch.Generator().manual_seed(3)
    k_cache = (torch.randn(20, 2, 16, generator=gen)).to(FP8).to(DEVICE)
    v_cache = (torch.randn(20, 2, 16, generator=gen)).to(FP8).to(DEVICE)
    k_before, v_before = k_cache.float(), v_cache.float()
    slots = torch.tensor([13, 2, 19, 7, 0], device=DEVICE)
    k = (torch.randn(5, 2, 16, generator=gen) * 4).to(DEVICE)
    v = (torch.randn(5, 2, 16, generator=gen) * 4).to(DEVICE)
    k[0, 0, :3] = torch.tensor([1e4, -1e4, 448.0])  # beyond e4m3's largest finite value: saturated, not NaN
    impl.store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(v_cache[slots].float(), v.to(FP8).float(), rtol=0, atol=0)  # in range: the plain cast
    assert k_cache[13, 0, :3].float().tolist() == [448.0, -448.0, 448.0]
    # e4m3 keeps 3 mantissa bits: each value within half a step (1/16 relative) of the input
    torch.testing.assert_close(k_cache[slots].float()[1:], k[1:], rtol=1 / 16, atol=2 ** -9)
    others = torch.ones(20, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    torch.testing.assert_close(k_cache[others].float(), k_before[others], rtol=0, atol=0)
    torch.testing.assert_close(v_cache[others].float(), v_before[others], rtol=0, atol=0)


@pytest.mark.parametrize("contexts, new", [([17, 40, 5], [17, 9, 1]), ([64, 33], [3, 33])])
def test_triton_prefill_over_an_fp8_pool_matches_reference(contexts, new):
    batch = fp8_pools(make_batch(contexts, new, seed=len(contexts), device=DEVICE))
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.cu_seqlens, batch.scale)
    expected = ref_attention.attention_prefill(batch.q, *args)
    out = triton_attention.attention_prefill(batch.q, *args, out=torch.full_like(batch.q, float("nan")),
                                             block_m=16, block_n=16)
    assert out.dtype == batch.q.dtype  # the queries' dtype, not the pool's
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_over_an_fp8_pool_matches_reference(num_splits):
    batch = fp8_pools(make_batch([65, 1, 30], [1, 1, 1], heads=6, kv_heads=2, seed=num_splits, device=DEVICE))
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.scale)
    expected = ref_attention.attention_decode(batch.q, *args)
    out = triton_attention.attention_decode(batch.q, *args, out=torch.full_like(batch.q, float("nan")),
                                            num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, expected, **TOL)


def test_decode_over_an_fp8_pool_takes_twice_the_keys_a_tile_by_default():
    """The default launch over an FP8 pool (128 keys a tile, a 16-bit pool's 64): contexts short
    of one tile, across two and of one key give the reference's output."""
    batch = fp8_pools(make_batch([300, 1, 129], [1, 1, 1], heads=6, kv_heads=2, seed=6, device=DEVICE))
    assert _default_decode_tile(batch.k_cache) == (128, 2)
    assert _default_decode_tile(batch.k_cache.to(torch.bfloat16)) == (64, 3)
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.scale)
    expected = ref_attention.attention_decode(batch.q, *args)
    out = triton_attention.attention_decode(batch.q, *args, out=torch.full_like(batch.q, float("nan")))
    torch.testing.assert_close(out, expected, **TOL)


def test_bf16_queries_over_an_fp8_pool_run_the_dots_in_fp16_without_overflow():
    """16-bit queries over an FP8 pool compute in fp16 (e4m3 widens to it in one instruction a
    pair): still the reference's output, and a query beyond fp16's range is clamped to it rather
    than turning the row's scores to inf and its output to NaN."""
    batch = fp8_pools(make_batch([65, 1, 30], [1, 1, 1], heads=6, kv_heads=2, seed=4, dtype=torch.bfloat16,
                                 device=DEVICE))
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.scale)
    expected = ref_attention.attention_decode(batch.q, *args).float()
    out = triton_attention.attention_decode(batch.q, *args, out=torch.full_like(batch.q, float("nan")),
                                            num_splits=2, block_n=16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    q = batch.q.clone()
    q[0, 0, 0] = 1e6  # a bf16 value fp16 cannot hold
    out = triton_attention.attention_decode(q, *args, out=torch.full_like(q, float("nan")), num_splits=2, block_n=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:].float(), expected[1:], atol=1e-2, rtol=1e-2)  # other rows untouched


@pytest.mark.slow
def test_shared_prefix_decode_over_an_fp8_pool_matches_reference():
    batch = make_shared_batch([(40, [3, 1, 7, 2, 5]), (9, [4, 4])], device=DEVICE, seed=5)
    batch = replace(batch, k_cache=ref_attention.to_pool_dtype(batch.k_cache, FP8),
                    v_cache=ref_attention.to_pool_dtype(batch.v_cache, FP8))
    expected = ref_attention.attention_decode(batch.q, *batch.args(), shared_with_prev=batch.common_prefix)
    launch = triton_attention.SharedPrefixLaunch(rows=4, block_n=16, num_splits=2)
    out = triton_attention.attention_decode(batch.q, *batch.args(), shared_with_prev=batch.common_prefix,
                                            num_splits=2, block_n=16, shared_launch=launch,
                                            out=torch.full_like(batch.q, float("nan")))
    torch.testing.assert_close(out, expected, **TOL)


def test_long_runs_get_the_fp8_context_widened_to_the_queries_dtype():
    """The per-sequence backends (cuDNN on a GPU; a stand-in here) take one dtype: the gathered
    FP8 context reaches them as the queries' dtype."""
    batch = fp8_pools(make_batch(CONTEXTS, NEW, seed=3))
    seen = []
    standin = sequence_standin([])

    def backend(q, k, v, scale, *policy):
        seen.append((k.dtype, v.dtype))
        return standin(q, k, v, scale)

    out = torch.full_like(batch.q, float("nan"))
    attention_prefill_with(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr,
                           batch.cu_seqlens, batch.scale, out=out, min_run=MIN_RUN, sequence_fn=backend,
                           short_fn=_reference_short)
    assert seen and set(seen) == {(batch.q.dtype, batch.q.dtype)}
    expected = ref_attention.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                               batch.kv_indptr, batch.cu_seqlens, batch.scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _reference_short(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *, out, max_seqlen=None):
    out.copy_(ref_attention.attention_prefill(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale))
    return out


def test_fp8_pool_attention_stays_near_the_full_precision_pool():
    """What storing the KV in e4m3 costs: outputs within a few hundredths of the fp32 pool's."""
    full = make_batch([80, 40], [80, 1], seed=9)
    quantized = fp8_pools(full)
    full = replace(full, k_cache=full.k_cache * 3, v_cache=full.v_cache * 3)
    args = lambda b: (b.k_cache, b.v_cache, b.kv_indices, b.kv_indptr, b.cu_seqlens, b.scale)  # noqa: E731
    exact = ref_attention.attention_prefill(full.q, *args(full))
    approx = ref_attention.attention_prefill(quantized.q, *args(quantized))
    error = (approx - exact).abs().max().item()
    assert 0 < error < 0.15 * exact.abs().max().item()


@requires_cuda
@pytest.mark.gpu
def test_fp8_pool_on_gpu_at_real_shapes_matches_reference():
    """bf16 queries over an e4m3 pool at the 27B head shapes: the prefill op (cuDNN for the long
    runs, Triton for the rest), the Triton prefill kernel, decode with and without the shared
    hint, and a decode graph replay, each against the fp32 reference over the same pool."""
    from batchinfer.kernels.attention import prefill

    batch = fp8_pools(make_batch(GPU_CONTEXTS, GPU_NEW, heads=24, kv_heads=4, d=256, dtype=torch.bfloat16,
                                 device="cuda"))
    indptr, cu = batch.kv_indptr.to(torch.int32), batch.cu_seqlens.to(torch.int32)
    expected = ref_attention.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, indptr, cu,
                                               batch.scale).float()
    out = torch.full_like(batch.q, float("nan"))
    prefill.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, indptr, cu, batch.scale, out=out)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    out = triton_attention.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices, indptr, cu,
                                             batch.scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    last = (batch.cu_seqlens[1:] - 1).long()
    q = batch.q[last].contiguous()
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, indptr, batch.scale)
    expected = ref_attention.attention_decode(q, *args).float()
    torch.testing.assert_close(triton_attention.attention_decode(q, *args).float(), expected, atol=2e-2, rtol=2e-2)
    no_sharing = torch.zeros(q.shape[0], dtype=torch.int32, device="cuda")
    shared = triton_attention.attention_decode(q, *args, shared_with_prev=no_sharing)
    torch.testing.assert_close(shared.float(), expected, atol=2e-2, rtol=2e-2)
    out = torch.full_like(q, float("nan"))
    triton_attention.attention_decode(q, *args, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_attention.attention_decode(q, *args, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


SM90_DECODE_CHILD = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchinfer.kernels.attention import attention as A

fn = A._attn_decode_split_kernel
names = fn.arg_names
constexprs = dict(GROUP=6, D=256, BLOCK_H=16, BLOCK_D=256, BLOCK_N=128, DOT_PRECISION="tf32", SHARED_ROWS=0,
                  LOOP_AS_WHILE=False)  # the 27B's heads (24 / 4 x 256), an FP8 pool's default launch
types = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "kv_indices_ptr": "*i32", "kv_indptr_ptr": "*i32",
         "shared_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "q_ptr": "*bf16"}
signature = {n: "constexpr" if n in constexprs else types.get(n, "fp32" if n == "scale" else "i32") for n in names}
source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
count = lambda pattern: len(re.findall(pattern, ptx))
print(count(r"cvt\\.rn\\.f16x2\\.e4m3x2"), count(r"cvt\\.bf16\\.f16"), count(r"mma\\.sync\\S*\\.f16\\.f16"))
"""


def test_fp8_decode_kernel_widens_to_fp16_on_sm90():
    """Compiled for sm_90a offline: an FP8 pool's tiles widen with the paired e4m3 → fp16
    instruction alone (no per-value fp16 → bf16 conversions after it, which bounded the kernel),
    and the dots run as fp16 tensor-core MMAs."""
    from tests.sm90_child import sm90_child_output

    pairs, to_bf16, fp16_mmas = map(int, sm90_child_output(SM90_DECODE_CHILD, timeout=600).split())
    assert pairs > 0 and to_bf16 == 0 and fp16_mmas > 0
