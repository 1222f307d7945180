"""Attention over the token-granular KV pool: the torch reference against an explicit softmax
loop, and the Triton kernels against the reference (TRITON_INTERPRET=1 on CPU, tiny shapes).

Contexts sit at scattered, out-of-order pool slots; every pool row that no context uses is
NaN, so reading a wrong slot fails, and outputs are NaN-poisoned before the kernels write.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import attention as triton_attention
from kernels.ref import attention as ref_attention
from tests.conftest import requires_cuda

# Tiny-shape kernel tests run compiled on a GPU, else in the Triton interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 inputs use ieee dots (kernels/attention.py); a GPU only reorders the fp32 sums.
TOL = {"rtol": 1e-5, "atol": 1e-5} if DEVICE == "cpu" else {"rtol": 1e-4, "atol": 1e-4}


@dataclass(frozen=True)
class Batch:
    """One step's attention inputs: pools, slot table and queries."""
    q: torch.Tensor  # [T, H, d]
    k_cache: torch.Tensor  # [S_kv, H_kv, d]
    v_cache: torch.Tensor
    kv_indices: torch.Tensor  # [Σ ctx]
    kv_indptr: torch.Tensor  # [B+1]
    cu_seqlens: torch.Tensor  # [B+1]
    scale: float


def make_batch(contexts, new_tokens, heads=4, kv_heads=2, d=16, dtype=torch.float32, device="cpu", seed=0):
    """Sequence i has contexts[i] tokens of which the last new_tokens[i] are new (queried)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(contexts)
    pool_size = 2 * total + 5
    k_cache = torch.full((pool_size, kv_heads, d), float("nan"))
    v_cache = torch.full((pool_size, kv_heads, d), float("nan"))
    kv_indices = torch.randperm(pool_size, generator=gen)[:total]
    k_cache[kv_indices] = torch.randn(total, kv_heads, d, generator=gen)
    v_cache[kv_indices] = torch.randn(total, kv_heads, d, generator=gen)
    kv_indptr = torch.tensor([0] + contexts).cumsum(0)
    cu_seqlens = torch.tensor([0] + new_tokens).cumsum(0)
    q = torch.randn(sum(new_tokens), heads, d, generator=gen)
    tensors = [x.to(device) for x in (q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens)]
    for i in range(3):
        tensors[i] = tensors[i].to(dtype)
    return Batch(*tensors, scale=d ** -0.5 * 1.7)


def explicit_attention(batch: Batch) -> torch.Tensor:
    """Ground truth by definition: per query, softmax over the visible keys, fp64."""
    out = torch.full(batch.q.shape, float("nan"), dtype=torch.float64)
    heads, kv_heads = batch.q.shape[1], batch.k_cache.shape[1]
    for i in range(len(batch.kv_indptr) - 1):
        idx = batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i + 1]]
        ctx = len(idx)
        first, last = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        for t in range(first, last):
            visible = idx[: ctx - (last - t) + 1]  # the query's own position included
            for h in range(heads):
                keys = batch.k_cache[visible, h // (heads // kv_heads)].double()
                values = batch.v_cache[visible, h // (heads // kv_heads)].double()
                weights = torch.softmax(keys @ batch.q[t, h].double() * batch.scale, 0)
                out[t, h] = weights @ values
    return out


def last_tokens(batch: Batch) -> torch.Tensor:
    """Index of each sequence's last new token: the decode query."""
    return batch.cu_seqlens[1:] - 1


# Context lengths around tile boundaries; new-token counts from one (decode-like) to all.
PREFILL_CASES = [
    ([65, 7, 64, 20], [3, 7, 64, 1]),
    ([63, 1, 33], [63, 1, 17]),
]


def test_reference_prefill_and_decode_match_definition():
    batch = make_batch(*PREFILL_CASES[0])
    expected = explicit_attention(batch)
    out = ref_attention.attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.kv_indices,
                                          batch.kv_indptr, batch.cu_seqlens, batch.scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    last = last_tokens(batch)
    out = ref_attention.attention_decode(batch.q[last], batch.k_cache, batch.v_cache, batch.kv_indices,
                                         batch.kv_indptr, batch.scale)
    torch.testing.assert_close(out.double(), expected[last], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_triton_prefill_matches_reference(case):
    batch = make_batch(*PREFILL_CASES[case], seed=case, device=DEVICE)
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.cu_seqlens, batch.scale)
    expected = ref_attention.attention_prefill(batch.q, *args)
    out = triton_attention.attention_prefill(batch.q, *args, out=torch.full_like(batch.q, float("nan")),
                                             block_m=16, block_n=16)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_triton_decode_matches_reference(num_splits):
    """Splits that are uneven, and (8 splits of a 1-token context) empty."""
    batch = make_batch([65, 1, 64, 130], [1, 1, 1, 1], heads=6, kv_heads=2, seed=num_splits, device=DEVICE)
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.scale)
    expected = ref_attention.attention_decode(batch.q, *args)
    out = triton_attention.attention_decode(batch.q, *args, out=torch.full_like(batch.q, float("nan")),
                                            num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("impl", [ref_attention, triton_attention], ids=["ref", "triton"])
def test_store_kv_writes_only_its_slots(impl):
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(20, 2, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(20, 2, 16, generator=gen).to(DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([13, 2, 19, 7, 0], device=DEVICE)
    k = torch.randn(5, 2, 16, generator=gen).to(DEVICE)
    v = torch.randn(5, 2, 16, generator=gen).to(DEVICE)
    impl.store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache[slots], v, rtol=0, atol=0)
    others = torch.ones(20, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    torch.testing.assert_close(k_cache[others], k_before[others], rtol=0, atol=0)
    torch.testing.assert_close(v_cache[others], v_before[others], rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference_on_cuda(dtype):
    """Real head shapes (24 heads / 4 KV heads × 256), contexts up to a few hundred tokens."""
    contexts, new = [300, 65, 1, 129, 64], [300, 2, 1, 64, 63]
    batch = make_batch(contexts, new, heads=24, kv_heads=4, d=256, dtype=dtype, device="cuda")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr)
    expected = ref_attention.attention_prefill(batch.q, *args, batch.cu_seqlens, batch.scale)
    out = triton_attention.attention_prefill(batch.q, *args, batch.cu_seqlens, batch.scale)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    last = last_tokens(batch)
    expected = ref_attention.attention_decode(batch.q[last], *args, batch.scale)
    out = triton_attention.attention_decode(batch.q[last], *args, batch.scale)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
