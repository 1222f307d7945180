"""Attention over the token-granular KV pool: the torch reference against an explicit softmax
loop, and the Triton kernels against the reference (TRITON_INTERPRET=1 on CPU, tiny shapes).

Contexts sit at scattered, out-of-order pool slots; every pool row that no context uses is
NaN, so reading a wrong slot fails, and outputs are NaN-poisoned before the kernels write.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from batchinfer.kernels import attention as triton_attention
from batchinfer.kernels.ref import attention as ref_attention
from tests.conftest import requires_cuda

# Tiny-shape kernel tests run compiled on a GPU, else in the Triton interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 inputs use ieee dots (kernels/attention/attention.py); a GPU only reorders the fp32 sums.
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


@pytest.mark.parametrize("num_splits", [1, 3, 8, 40])
def test_triton_decode_matches_reference(num_splits):
    """Splits that are uneven, and (8 splits of a 1-token context) empty; 40: more splits than
    one merge block holds (the second block all empty)."""
    batch = make_batch([65, 1, 64, 130], [1, 1, 1, 1], heads=6, kv_heads=2, seed=num_splits, device=DEVICE)
    args = (batch.k_cache, batch.v_cache, batch.kv_indices, batch.kv_indptr, batch.scale)
    expected = ref_attention.attention_decode(batch.q, *args)
    out = triton_attention.attention_decode(batch.q, *args, out=torch.full_like(batch.q, float("nan")),
                                            num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("num_splits, live", [(40, [33, 39]), (70, [0, 65, 69]), (5, [4])])
def test_decode_merge_folds_blocks_of_splits(num_splits, live):
    """The merge walks the splits in blocks of MERGE_BLOCK_S: blocks with no live split (lse
    -inf, parts NaN) before and after the live ones carry no weight."""
    from batchinfer.kernels.attention import attention as attention_module

    gen = torch.Generator().manual_seed(num_splits)
    B, H, d = 2, 3, 16
    part_o = torch.full((B, H, num_splits, d), float("nan"))
    part_lse = torch.full((B, H, num_splits), float("-inf"))
    part_o[:, :, live] = torch.randn(B, H, len(live), d, generator=gen)
    part_lse[:, :, live] = torch.randn(B, H, len(live), generator=gen) * 3
    weight = torch.softmax(part_lse[:, :, live], dim=-1)  # [B, H, live]
    expected = (part_o[:, :, live] * weight[..., None]).sum(2)
    part_o, part_lse = part_o.to(DEVICE), part_lse.to(DEVICE)
    out = torch.full((B, H, d), float("nan"), device=DEVICE)
    attention_module._attn_decode_merge_kernel[(B, H)](
        part_o, part_lse, out, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1), num_splits, D=d, BLOCK_S=attention_module.MERGE_BLOCK_S,
        BLOCK_D=d, LOOP_AS_WHILE=attention_module.LOOP_AS_WHILE)
    torch.testing.assert_close(out.cpu(), expected, **TOL)


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


# ---------------------------------------------------------------- shared-prefix decode hint

@dataclass(frozen=True)
class SharedBatch:
    """A decode step whose consecutive rows share context prefixes (the same pool slots)."""
    q: torch.Tensor  # [B, H, d]
    k_cache: torch.Tensor  # [S_kv, H_kv, d]
    v_cache: torch.Tensor
    kv_indices: torch.Tensor  # [Σ ctx]
    kv_indptr: torch.Tensor  # [B+1]
    common_prefix: torch.Tensor  # [B] int32: true leading slots shared with the previous row (0 for row 0)
    scale: float

    def args(self):
        return self.k_cache, self.v_cache, self.kv_indices, self.kv_indptr, self.scale


def make_shared_batch(groups, heads=6, kv_heads=2, d=16, dtype=torch.float32, device="cpu", seed=0):
    """groups: [(prefix_len, [own_len, ...]), ...]. Every member of a group holds the group's
    prefix slots, then own slots; all slots distinct otherwise, scattered out of order over a
    pool whose unused rows are NaN."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(prefix + sum(owns) for prefix, owns in groups)
    pool_size = 2 * total + 5
    free = torch.randperm(pool_size, generator=gen).tolist()
    contexts = []
    for prefix, owns in groups:
        shared, free = free[:prefix], free[prefix:]
        for own in owns:
            contexts.append(shared + free[:own])
            free = free[own:]
    k_cache = torch.full((pool_size, kv_heads, d), float("nan"))
    v_cache = torch.full((pool_size, kv_heads, d), float("nan"))
    used = torch.tensor(sorted({s for ctx in contexts for s in ctx}))
    k_cache[used] = torch.randn(len(used), kv_heads, d, generator=gen)
    v_cache[used] = torch.randn(len(used), kv_heads, d, generator=gen)
    common = [0] + [_common_prefix_len(a, b) for a, b in zip(contexts, contexts[1:])]
    q = torch.randn(len(contexts), heads, d, generator=gen)
    return SharedBatch(q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
                       torch.tensor(sum(contexts, [])).to(device),
                       torch.tensor([0] + [len(c) for c in contexts]).cumsum(0).to(device),
                       torch.tensor(common, dtype=torch.int32, device=device), d ** -0.5 * 1.7)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# Row blocks of 4 at these tests' sizes. Groups of R, R+1, R-1 and 1 rows that straddle blocks;
# shared lengths around the 16-token tiles (63/64/65), 1, a row's whole context minus 1, and a
# whole context (own 0: two rows with identical contexts).
SHARED_ROWS = 4
SHARED_CASES = {
    "straddling": [(65, [3, 1, 7, 2]), (64, [9, 2, 1, 5, 3]), (63, [4, 1, 2]), (33, [2])],
    "edges": [(1, [5, 3, 64]), (40, [1, 1, 1, 1]), (20, [0, 6, 0]), (0, [17, 2])],
}


def _hints(batch: SharedBatch, mode: str, seed: int) -> torch.Tensor:
    """The promise a caller may make: the true common prefix, anything smaller, or nothing."""
    if mode == "exact":
        return batch.common_prefix
    if mode == "zero":
        return torch.zeros_like(batch.common_prefix)
    gen = torch.Generator().manual_seed(seed)
    fraction = torch.rand(batch.common_prefix.shape, generator=gen).to(batch.common_prefix.device)
    return (batch.common_prefix * fraction).to(torch.int32)  # "smaller": in [0, true]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("case, mode, dtype_name, stage_splits", [
    ("straddling", "exact", "fp32", 3),
    ("straddling", "smaller", "fp32", 2),
    ("straddling", "zero", "fp32", 2),
    ("edges", "exact", "fp32", 3),
    ("edges", "smaller", "fp32", None),
    ("straddling", "exact", "bf16", 3),
    ("edges", "exact", "bf16", 2),
])
@pytest.mark.slow
def test_shared_prefix_decode_matches_reference(case, mode, dtype_name, stage_splits):
    """Stage splits None: from shapes (one on the CPU); 2 and 3 cut the prefixes unevenly."""
    dtype = DTYPES[dtype_name]
    batch = make_shared_batch(SHARED_CASES[case], dtype=dtype, device=DEVICE, seed=len(case))
    hints = _hints(batch, mode, seed=7)
    expected = ref_attention.attention_decode(batch.q, *batch.args(), shared_with_prev=hints)
    launch = triton_attention.SharedPrefixLaunch(rows=SHARED_ROWS, block_n=16, num_splits=stage_splits)
    out = triton_attention.attention_decode(batch.q, *batch.args(), shared_with_prev=hints, num_splits=2,
                                            block_n=16, shared_launch=launch,
                                            out=torch.full_like(batch.q, float("nan")))
    tol = TOL if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), expected.float(), **tol)


def _two_rows_diverging_at(diverge: int, ctx: int = 80, seed: int = 3) -> SharedBatch:
    """Two rows of `ctx` tokens whose slots agree on [0, diverge) and differ after."""
    return make_shared_batch([(diverge, [ctx - diverge, ctx - diverge])], device=DEVICE, seed=seed)


@pytest.mark.parametrize("hint", [50, 17])
def test_shared_hint_is_honoured_only_where_promised(hint):
    """Rows agree on 50 slots, then differ (same lengths, so reading row 0's tail for row 1
    would go unnoticed by shape): the shared stage must stop at the hint."""
    batch = _two_rows_diverging_at(50)
    hints = torch.tensor([0, hint], dtype=torch.int32, device=DEVICE)
    expected = ref_attention.attention_decode(batch.q, *batch.args(), shared_with_prev=hints)
    out = triton_attention.attention_decode(
        batch.q, *batch.args(), shared_with_prev=hints, block_n=16,
        shared_launch=triton_attention.SharedPrefixLaunch(rows=2, block_n=16, num_splits=2),
        out=torch.full_like(batch.q, float("nan")))
    torch.testing.assert_close(out, expected, **TOL)


def test_shared_stage_reads_the_first_rows_slots():
    """A broken promise (rows really diverge at 30, hint 50) must change row 1's answer — proof
    that the hint takes the fast path — and leave row 0's alone."""
    batch = _two_rows_diverging_at(30)
    lying = torch.tensor([0, 50], dtype=torch.int32, device=DEVICE)
    expected = ref_attention.attention_decode(batch.q, *batch.args())
    out = triton_attention.attention_decode(
        batch.q, *batch.args(), shared_with_prev=lying, block_n=16,
        shared_launch=triton_attention.SharedPrefixLaunch(rows=2, block_n=16))
    torch.testing.assert_close(out[0], expected[0], **TOL)
    assert (out[1] - expected[1]).abs().max() > 1e-2


def test_reference_rejects_a_broken_hint():
    batch = _two_rows_diverging_at(30)
    ref_attention.attention_decode(batch.q, *batch.args(), shared_with_prev=batch.common_prefix)
    with pytest.raises(ValueError, match="differ"):
        ref_attention.attention_decode(batch.q, *batch.args(),
                                       shared_with_prev=torch.tensor([0, 31], dtype=torch.int32))
    with pytest.raises(ValueError, match="exceeds"):
        ref_attention.attention_decode(batch.q, *batch.args(),
                                       shared_with_prev=torch.tensor([0, 81], dtype=torch.int32))


@requires_cuda
def test_shared_prefix_decode_on_cuda_real_shapes_and_graph_replay():
    """24 / 4 heads × 256, bf16, B=64 in 4 groups of 16 sharing 1000 tokens, own 37..90; then a
    CUDA graph captured with one hint buffer replays with other contents (zero, then exact)."""
    gen = torch.Generator().manual_seed(11)
    groups = [(1000, torch.randint(37, 91, (16,), generator=gen).tolist()) for _ in range(4)]
    batch = make_shared_batch(groups, heads=24, kv_heads=4, d=256, dtype=torch.bfloat16, device="cuda")
    expected = ref_attention.attention_decode(batch.q, *batch.args()).float()
    tol = {"rtol": 2e-2, "atol": 2e-2}
    out = triton_attention.attention_decode(batch.q, *batch.args(), shared_with_prev=batch.common_prefix)
    torch.testing.assert_close(out.float(), expected, **tol)

    hints = torch.zeros_like(batch.common_prefix)
    out = torch.full_like(batch.q, float("nan"))

    def run():
        triton_attention.attention_decode(batch.q, *batch.args(), shared_with_prev=hints, out=out)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for contents in (torch.zeros_like(hints), batch.common_prefix):
        hints.copy_(contents)
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out.float(), expected, **tol)
