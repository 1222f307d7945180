"""Regression test for the published extra_buffer + ReplaySSM bug: a tracked state donated
while the ring held pending entries (cursor > 0) must resume a second request exactly as a
from-scratch computation would. Broken pools (fold skipped, cursor reset skipped) must fail it.
"""
from __future__ import annotations

import pytest
import torch

from batchinfer.cache.cache_config import CacheConfig
from batchinfer.cache.kv_pool import KVPool
from batchinfer.cache.shapes import GdnStateShape, KVShape
from batchinfer.cache.state_cache import StateCache
from batchinfer.cache.state_pool import GdnStatePool
from batchinfer.kernels import ops
from batchinfer.kernels.ref.gdn import gdn_decode as gdn_decode_ref

H_K, H_V, D_K, D_V, K_CONV, RING = 1, 2, 4, 4, 4, 4
CONV_DIM = 2 * H_K * D_K + H_V * D_V
VOCAB, LAYERS = 32, 2


class TinyGdnStack:
    """Two GDN layers (conv + delta rule) on per-token random inputs: enough "model" to see a
    wrong state in the outputs. Each layer reads the same token features (no mixing)."""

    def __init__(self, gen: torch.Generator) -> None:
        self.x = torch.randn(LAYERS, VOCAB, CONV_DIM, generator=gen)          # token → conv input
        self.a = torch.randn(LAYERS, VOCAB, H_V, generator=gen)
        self.b = torch.randn(LAYERS, VOCAB, H_V, generator=gen)
        self.conv_w = torch.randn(LAYERS, CONV_DIM, K_CONV, generator=gen) * 0.5
        self.A_log = torch.randn(LAYERS, H_V, generator=gen) * 0.5
        self.dt_bias = torch.randn(LAYERS, H_V, generator=gen) * 0.5

    def step(self, pool: GdnStatePool, slot: int, token: int, replay: bool) -> torch.Tensor:
        """One token through both layers at `slot`; returns outputs [LAYERS, H_V, D_V]."""
        slots = torch.tensor([slot])
        outs = []
        for j in range(LAYERS):
            y = ops.causal_conv1d_decode(self.x[j, token][None], self.conv_w[j], None, pool.conv[j], slots)
            q, k, v = y.split([H_K * D_K, H_K * D_K, H_V * D_V], dim=-1)
            args = (q.view(1, H_K, D_K), k.view(1, H_K, D_K), v.view(1, H_V, D_V), self.a[j, token][None],
                    self.b[j, token][None], self.A_log[j], self.dt_bias[j])
            if replay:
                outs.append(ops.replay_decode(*args, pool.ssm[j], pool.ring_k[j], pool.ring_u[j], pool.ring_g[j],
                                              pool.cursor, slots))
            else:
                outs.append(gdn_decode_ref(*args, pool.ssm[j], slots))
        if replay:  # the model runner's job: once per step, for all layers
            pool.cursor[slots] = pool.cursor[slots] % RING + 1
        return torch.cat(outs)


class SkipFoldPool(GdnStatePool):
    """Broken: copies the checkpoint as is, dropping the source's pending ring entries."""

    def copy(self, src, dst):
        src, dst = int(src), int(dst)
        for conv, ssm in zip(self.conv, self.ssm):
            conv[dst] = conv[src]
            ssm[dst] = ssm[src]
        self.cursor[dst] = 0


class NoCursorResetPool(GdnStatePool):
    """Broken: folds correctly but never resets a destination cursor (stale ring entries count)."""

    def copy(self, src, dst):
        src_t, dst_t = torch.tensor([int(src)]), torch.tensor([int(dst)])
        for j in range(self.shape.num_layers):
            self.conv[j][dst_t] = self.conv[j][src_t]
            ops.replay_fold(self.ssm[j], self.ring_k[j], self.ring_u[j], self.ring_g[j], self.cursor, src_t, dst_t)

    def reset_cursor(self, slots):
        pass


def _make_pool(pool_cls, replay: bool) -> GdnStatePool:
    shape = GdnStateShape(num_layers=LAYERS, conv_dim=CONV_DIM, conv_kernel=K_CONV, num_k_heads=H_K,
                          num_v_heads=H_V, head_k_dim=D_K, head_v_dim=D_V, conv_dtype=torch.float32,
                          ssm_dtype=torch.float32, ring_len=RING if replay else 0)
    return pool_cls(8, shape)


def _dirty_free_slots(pool: GdnStatePool, model: TinyGdnStack, gen: torch.Generator, replay: bool) -> None:
    """Earlier tenants left garbage: random states and rings, cursors mid-ring (freed slots keep it)."""
    for slot in range(pool.num_slots):
        for token in torch.randint(0, VOCAB, (RING + 3,), generator=gen).tolist():
            model.step(pool, slot, token, replay)
    if replay:
        assert bool((pool.cursor[:pool.num_slots] > 0).all())


def _run_shared_prefix(pool_cls, replay: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request A computes prefix+suffix, tracks the state at the prefix end (ring mid-way), donates
    it; request B resumes from it. Returns (B's outputs from the cache, B's outputs from scratch)."""
    gen = torch.Generator().manual_seed(seed)
    model = TinyGdnStack(gen)
    pool = _make_pool(pool_cls, replay)
    _dirty_free_slots(pool, model, gen, replay)
    kv_shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache = StateCache(KVPool(128, kv_shape), pool, CacheConfig(mode="extra_buffer"))

    prefix_len = 2 * RING + 3  # 11: not a ring multiple, so A's cursor is 3 when it tracks
    prefix = torch.randint(0, VOCAB, (prefix_len,), generator=gen).tolist()
    prompt_a = prefix + torch.randint(0, VOCAB, (5,), generator=gen).tolist()
    prompt_b = prefix + torch.randint(0, VOCAB, (6,), generator=gen).tolist()

    seq_a = cache.admit("a", prompt_a)
    for position, token in enumerate(prompt_a, start=1):
        model.step(pool, seq_a.working_slot, token, replay)
        if position == prefix_len:
            if replay:
                assert int(pool.cursor[seq_a.working_slot]) == prefix_len % RING  # pending entries
            assert cache.track(seq_a, position)
    assert cache.donate(seq_a) == 1  # after A moved on: the snapshot must not follow the working slot
    cache.finish(seq_a)
    cache.audit()

    seq_b = cache.admit("b", prompt_b)
    assert seq_b.resume_len == prefix_len
    cached = torch.stack([model.step(pool, seq_b.working_slot, t, replay) for t in prompt_b[prefix_len:]])

    scratch = _make_pool(GdnStatePool, replay=False)  # plain recurrence from a zero state
    fresh = torch.stack([model.step(scratch, 0, t, replay=False) for t in prompt_b])[prefix_len:]
    cache.finish(seq_b)
    cache.audit()
    return cached, fresh


@pytest.mark.parametrize("replay", [True, False], ids=["replayssm", "recurrent"])
@pytest.mark.parametrize("seed", [0, 1])
def test_resume_from_donated_state_matches_scratch(replay, seed):
    cached, fresh = _run_shared_prefix(GdnStatePool, replay, seed)
    torch.testing.assert_close(cached, fresh, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("broken_pool", [SkipFoldPool, NoCursorResetPool], ids=["skip_fold", "no_cursor_reset"])
def test_broken_state_moves_are_caught(broken_pool):
    """The test above has teeth: either bug makes the resumed outputs drift."""
    cached, fresh = _run_shared_prefix(broken_pool, replay=True, seed=0)
    assert (cached - fresh).abs().max() > 1e-3
