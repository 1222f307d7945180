"""KVPool / GdnStatePool: allocation, ownership errors, state moves (zero, copy with fold, flush)."""
from __future__ import annotations

import pytest
import torch

from batchinfer.models.forward_batch import ModelCaches
from batchinfer.cache.kv_pool import KVPool
from batchinfer.cache.shapes import GdnStateShape, KVShape
from batchinfer.cache.slot_owner import DoubleFreeError, FreeList
from batchinfer.cache.state_pool import GdnStatePool
from batchinfer.kernels.ref.replay import replay_state
from tests.conftest import requires_cuda

H_K, H_V, D_K, D_V, RING = 1, 2, 3, 5, 4


def _state_shape(ring_len: int) -> GdnStateShape:
    return GdnStateShape(num_layers=2, conv_dim=2 * H_K * D_K + H_V * D_V, conv_kernel=4, num_k_heads=H_K,
                         num_v_heads=H_V, head_k_dim=D_K, head_v_dim=D_V, conv_dtype=torch.float32,
                         ssm_dtype=torch.float32, ring_len=ring_len)


def _randomise(pool: GdnStatePool, gen: torch.Generator) -> None:
    for tensors in (pool.conv, pool.ssm, pool.ring_k, pool.ring_u):
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=gen))
    for t in pool.ring_g:  # cumulative log decay: non-increasing along the ring
        t.copy_(-torch.rand(t.shape, generator=gen).cumsum(1))
    pool.cursor.copy_(torch.randint(1, RING + 1, pool.cursor.shape, generator=gen))


def test_kv_pool_alloc_free_and_double_free():
    pool = KVPool(10, KVShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32))
    assert len(pool.k) == 3 and pool.k[0].shape == (11, 2, 4) and pool.pad_slot == 10
    a = pool.alloc(7)
    assert a.numel() == 7 and torch.unique(a).numel() == 7 and pool.num_free == 3
    assert pool.alloc(4) is None and pool.num_free == 3  # nothing taken on failure
    pool.free(a[:3])
    with pytest.raises(DoubleFreeError):
        pool.free(a[:1])
    with pytest.raises(DoubleFreeError):
        pool.free(torch.tensor([a[4], a[4]]))
    with pytest.raises(DoubleFreeError):
        pool.free([10])  # the pad slot is never allocated
    assert pool.num_used == 4
    pool.audit()


def test_free_list_never_hands_out_an_index_twice():
    fl = FreeList(6)
    taken = torch.cat([fl.alloc(2), fl.alloc(3)])
    fl.free(taken[1:4])
    again = fl.alloc(4)
    assert set(again.tolist()).isdisjoint({int(taken[0]), int(taken[4])}) and fl.num_free == 0
    fl.audit()


def test_state_pool_shapes_and_alloc():
    pool = GdnStatePool(3, _state_shape(RING))
    assert pool.conv[1].shape == (4, 2 * D_K + H_V * D_V, 3) and pool.ssm[0].shape == (4, H_V, D_K, D_V)
    assert pool.ring_k[0].shape == (4, RING, H_K, D_K) and pool.ring_g[0].shape == (4, RING, H_V)
    assert pool.cursor.dtype == torch.int32 and pool.cursor.shape == (4,)
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.alloc() is None
    pool.free(slots[1])
    with pytest.raises(DoubleFreeError):
        pool.free(slots[1])
    assert GdnStatePool(2, _state_shape(0)).ring_k == []


def test_zero_resets_state_and_cursor_only_of_given_slots():
    pool = GdnStatePool(4, _state_shape(RING))
    _randomise(pool, torch.Generator().manual_seed(0))
    pool.zero_([2, 0])
    for j in range(2):
        assert not pool.conv[j][[0, 2]].any() and not pool.ssm[j][[0, 2]].any()
        assert pool.conv[j][[1, 3]].abs().sum() > 0
    assert pool.cursor[[0, 2]].tolist() == [0, 0] and bool((pool.cursor[[1, 3]] > 0).all())


@pytest.mark.parametrize("ring_len", [0, RING], ids=["recurrent", "replayssm"])
def test_copy_folds_resets_cursor_and_leaves_source(ring_len):
    pool = GdnStatePool(5, _state_shape(ring_len))
    _randomise(pool, torch.Generator().manual_seed(1))
    if ring_len:
        pool.cursor[[1, 3]] = torch.tensor([3, RING], dtype=torch.int32)  # partial and full rings
    src_before = [(c[[1, 3]].clone(), s[[1, 3]].clone()) for c, s in zip(pool.conv, pool.ssm)]
    expected = [[replay_state(pool.ssm[j], pool.ring_k[j], pool.ring_u[j], pool.ring_g[j], pool.cursor, s)
                 if ring_len else pool.ssm[j][s].clone() for s in (1, 3)] for j in range(2)]
    pool.copy([1, 3], [4, 0])
    for j in range(2):
        torch.testing.assert_close(pool.conv[j][[4, 0]], src_before[j][0], rtol=0, atol=0)
        torch.testing.assert_close(pool.ssm[j][4], expected[j][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pool.ssm[j][0], expected[j][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pool.ssm[j][[1, 3]], src_before[j][1], rtol=0, atol=0)  # src untouched
    assert pool.cursor[[4, 0]].tolist() == [0, 0]
    if ring_len:
        assert pool.cursor[[1, 3]].tolist() == [3, RING]
    with pytest.raises(ValueError):
        pool.copy([2], [2])


def test_flush_keeps_the_state_and_empties_the_ring():
    pool = GdnStatePool(3, _state_shape(RING))
    _randomise(pool, torch.Generator().manual_seed(2))
    before = [replay_state(pool.ssm[j], pool.ring_k[j], pool.ring_u[j], pool.ring_g[j], pool.cursor, 2)
              for j in range(2)]
    pool.flush(2)
    assert int(pool.cursor[2]) == 0
    for j in range(2):
        torch.testing.assert_close(pool.ssm[j][2], before[j], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ring_len", [0, RING], ids=["recurrent", "replayssm"])
def test_model_caches_are_the_pools_own_tensors(ring_len):
    kv = KVPool(5, KVShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32))
    pool = GdnStatePool(3, _state_shape(ring_len))
    caches = ModelCaches.from_pools(kv, pool)
    assert caches.kv_k[1] is kv.k[1] and caches.kv_v[0] is kv.v[0]
    assert caches.conv[1] is pool.conv[1] and caches.ssm[0] is pool.ssm[0] and caches.cursor is pool.cursor
    assert caches.has_replay == bool(ring_len) and caches.ring_len == ring_len
    if ring_len:
        assert caches.ring_k[1] is pool.ring_k[1] and caches.ring_g[0] is pool.ring_g[0]


def test_copy_rejects_chained_pairs():
    pool = GdnStatePool(4, _state_shape(RING))
    with pytest.raises(ValueError):
        pool.copy([0, 1], [1, 2])  # 1 is written and read in one batch
    with pytest.raises(ValueError):
        pool.copy([0, 1], [2, 2])


@requires_cuda
@pytest.mark.gpu
def test_cuda_copy_and_flush_match_cpu_reference():
    """The pool's state moves through the Triton fold (bf16 checkpoints) agree with the CPU path."""
    shape = GdnStateShape(num_layers=2, conv_dim=2 * 2 * 64 + 4 * 64, conv_kernel=4, num_k_heads=2,
                          num_v_heads=4, head_k_dim=64, head_v_dim=64, conv_dtype=torch.bfloat16,
                          ssm_dtype=torch.bfloat16, ring_len=8)
    cpu, gpu = GdnStatePool(6, shape, "cpu"), GdnStatePool(6, shape, "cuda")
    gen = torch.Generator().manual_seed(3)
    for name in ("conv", "ssm", "ring_k", "ring_u"):
        for a, b in zip(getattr(cpu, name), getattr(gpu, name)):
            a.copy_(torch.randn(a.shape, generator=gen))
            b.copy_(a)
    for a, b in zip(cpu.ring_g, gpu.ring_g):
        a.copy_(-torch.rand(a.shape, generator=gen).cumsum(1))
        b.copy_(a)
    cpu.cursor.copy_(torch.randint(0, 9, cpu.cursor.shape, generator=gen))
    gpu.cursor.copy_(cpu.cursor)
    for pool in (cpu, gpu):
        pool.copy([1, 3, 5], [0, 2, 4])
        pool.flush([1])
    assert torch.equal(gpu.cursor.cpu(), cpu.cursor)
    for j in range(2):
        torch.testing.assert_close(gpu.conv[j].cpu(), cpu.conv[j], rtol=0, atol=0)
        torch.testing.assert_close(gpu.ssm[j].cpu().float(), cpu.ssm[j].float(), rtol=2e-2, atol=2e-2)
