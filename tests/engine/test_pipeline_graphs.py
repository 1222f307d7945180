"""The per-stage decode graphs' path (engine/stage_graphs.py) on the CPU (capture=False): padding
rows of a bucket touch only the pad slots of every stage's own pools, the logits equal the eager
pipeline's, and stage pools without a pad row are refused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.engine.model_runner import DecodeRows, build_decode_batch
from batchinfer.engine.pipeline_pools import build_pipeline_pools
from batchinfer.engine.stage_graphs import check_pad_slots, stage_decode_graphs
from batchinfer.models.pipeline import StagedCaches
from batchinfer.models.pipeline_build import random_pipelined_model
from batchinfer.models.presets import preset_config

CPU = torch.device("cpu")
KV_SLOTS, STATE_SLOTS = 40, 6


def _pipeline(stages: int):
    config = preset_config("tiny")
    model = random_pipelined_model(config, torch.float32, [CPU] * stages, seed=4)
    kv_shape, state_shape = shapes_from_model_config(config, torch.float32, ring_len=4, ckpt_dtype=torch.float32)
    plan = SimpleNamespace(kv_slots=KV_SLOTS, state_slots=STATE_SLOTS)
    kv_pool, state_pool = build_pipeline_pools(model, plan, kv_shape, state_shape)
    generator = torch.Generator().manual_seed(0)
    for tensor in _pool_tensors(kv_pool, state_pool):
        if tensor.is_floating_point():  # noise: a write shows even where it writes zeros over zeros
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
    return model, kv_pool, state_pool


def _pool_tensors(kv_pool, state_pool) -> list[torch.Tensor]:
    out = []
    for kv in kv_pool.stages:
        out += [*kv.k, *kv.v]
    for st in state_pool.stages:
        out += [*st.conv, *st.ssm, *st.ring_k, *st.ring_u, *st.ring_g, st.cursor]
    return out


def _rows_changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    diff = (before != after).reshape(before.shape[0], -1).any(dim=1)
    return set(diff.nonzero().flatten().tolist())


def _step_rows():
    """Three decode rows (bucket 4: one padding row), contexts of 3, 5 and 2 KV slots."""
    positions = [2, 4, 1]
    kv = torch.tensor([3, 4, 5, 10, 11, 12, 13, 14, 20, 21])
    return DecodeRows(token_ids=[7, 8, 9], positions=positions, state_slots=[4, 0, 2], kv_indices=kv)


@pytest.mark.parametrize("stages,copy_hand_over", [(2, False), (4, False), (2, True)])
def test_padding_rows_touch_only_every_stages_pad_slots(stages, copy_hand_over):
    model, kv_pool, state_pool = _pipeline(stages)
    caches = StagedCaches.from_pools(kv_pool, state_pool)
    graphs = stage_decode_graphs(model, caches, CPU, replay=True, max_batch=4, kv_pool=kv_pool,
                                 state_pool=state_pool, ctx_cap=8, capture=False, copy_hand_over=copy_hand_over)
    rows = _step_rows()
    before = [t.clone() for t in _pool_tensors(kv_pool, state_pool)]
    logits = graphs.run(rows.token_ids, rows.positions, rows.state_slots, rows.kv_indices).clone()
    assert graphs.replays == 1 and logits.shape[0] == 3
    new_kv = {5, 14, 21}  # each row's new token ends its context
    kv_layers = sum(len(kv.k) for kv in kv_pool.stages)
    written = 0
    for i, (old, new) in enumerate(zip(before, _pool_tensors(kv_pool, state_pool))):
        changed = _rows_changed(old, new)
        live, pad = (new_kv, kv_pool.pad_slot) if i < 2 * kv_layers else (set(rows.state_slots), state_pool.pad_slot)
        assert changed - live <= {pad}, f"pool tensor {i} written outside its live rows and pad slot"
        if changed:  # a tensor the step writes (ReplaySSM leaves the snapshot): the padding row ran there too
            assert pad in changed, f"pool tensor {i}: the padding row did not run there"
            written += 1
    assert written >= 2 * kv_layers + 4 * 3  # every KV layer; conv, ring k/u/g of every GDN layer

    # The same step through the eager pipeline (no padding) from the same pools gives the same logits.
    for old, now in zip(before, _pool_tensors(kv_pool, state_pool)):
        now.copy_(old)
    eager = model.forward(build_decode_batch(rows, replay=True, device=CPU), caches)
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)


def test_stage_pools_without_the_pad_slot_are_refused():
    _, kv_pool, state_pool = _pipeline(2)
    state_pool.stages[1] = SimpleNamespace(pad_slot=STATE_SLOTS - 1)
    with pytest.raises(ValueError, match="pipeline stage 1's state pool has no pad slot 6"):
        check_pad_slots(kv_pool, state_pool)


def test_the_pipeline_benchmark_reports_the_graphs_used():
    from benchmarks.pipeline_one_gpu import graphs_used

    model, kv_pool, state_pool = _pipeline(2)
    graphs = stage_decode_graphs(model, StagedCaches.from_pools(kv_pool, state_pool), CPU, replay=True, max_batch=4,
                                 kv_pool=kv_pool, state_pool=state_pool, ctx_cap=8, capture=False)
    rows = _step_rows()
    graphs.run(rows.token_ids, rows.positions, rows.state_slots, rows.kv_indices)
    assert graphs_used(graphs, 0) == "per stage, 1 replays" and graphs_used(None, 0) == "off"
