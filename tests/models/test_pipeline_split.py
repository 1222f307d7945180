"""Pipeline stages' pure parts: the layer cost estimate and split, the fit check, staged pools
moving states in step, decode micro-batches, random weights equal to the whole model's."""
from __future__ import annotations

import pytest
import torch

from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.cache.staged_pools import StagedStatePool, StageShapes, plan_stage_pools
from batchinfer.models.micro_batches import split_decode
from batchinfer.models.pipeline_build import random_pipelined_model
from batchinfer.models.presets import preset_config, random_model
from batchinfer.models.stage_split import check_stages_fit, layer_cost, split_layers


def test_layer_costs_differ_by_kind():
    dense, moe = preset_config("qwen3.5-27b"), preset_config("qwen3.5-122b-a10b")
    gdn, attn = layer_cost(dense, 0), layer_cost(dense, 3)  # 3 GDN then 1 attention
    assert gdn.weight_params != attn.weight_params and gdn.active_params == gdn.weight_params
    expert = layer_cost(moe, 0)
    assert expert.active_params < expert.weight_params / 5  # 8 of 256 experts compute per token


def test_split_is_contiguous_balanced_and_carries_the_ends():
    config = preset_config("qwen3.5-27b")
    split = split_layers(config, 4)
    assert split.bounds[0][0] == 0 and split.bounds[-1][1] == config.num_layers
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(split.bounds, split.bounds[1:]))
    assert split.balance > 0.9
    # The first and last stages carry the embedding and the LM head: they get fewer layers.
    sizes = [b - a for a, b in split.bounds]
    assert sizes[0] < max(sizes) and sizes[-1] < max(sizes)
    assert "stage 3: layers" in split.describe() and "balance" in split.describe()


def test_split_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="pipeline_stages must be between 1 and the model's 4 layers"):
        split_layers(preset_config("tiny"), 5)


def test_fit_check_names_model_size_and_memory():
    split = split_layers(preset_config("qwen3.5-397b-a17b"), 2)
    with pytest.raises(ValueError, match=r"GiB of weights\) does not fit 2 pipeline stages: stage \d needs .* GiB "
                                         r"available"):
        check_stages_fit(split, [140 << 30] * 2, "qwen3.5-397b-a17b")
    check_stages_fit(split, [1 << 50] * 2)


def test_random_pipelined_weights_are_the_whole_models():
    config = preset_config("tiny")
    whole = dict(random_model(config, torch.float32, "cpu", seed=3).named_parameters())
    staged = random_pipelined_model(config, torch.float32, [torch.device("cpu")] * 3, seed=3)
    seen = set()
    for stage in staged.stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param, whole[name]), name
            seen.add(name)
    assert seen == set(whole)


def test_staged_state_pool_moves_every_stage_in_step():
    config = preset_config("tiny")
    _, state = shapes_from_model_config(config, torch.float32, ring_len=4)
    from dataclasses import replace
    pool = StagedStatePool(6, [replace(state, num_layers=2), replace(state, num_layers=1)],
                           [torch.device("cpu")] * 2)
    src, dst = pool.alloc(), pool.alloc()
    for stage in pool.stages:
        for ssm in stage.ssm:
            ssm[src] = 1.0
    pool.copy(src, dst)
    assert all(torch.all(ssm[dst] == 1.0) for stage in pool.stages for ssm in stage.ssm)
    pool.zero_(dst)
    assert all(torch.all(ssm[dst] == 0.0) for stage in pool.stages for ssm in stage.ssm)
    assert pool.num_used == 2 and all(stage.num_used == 0 for stage in pool.stages)  # one owner: the staged pool


def test_stage_pools_fit_the_tightest_stage():
    config = preset_config("tiny")
    kv, state = shapes_from_model_config(config, torch.float32)
    from dataclasses import replace
    stages = [StageShapes(replace(kv, num_layers=0), replace(state, num_layers=3)),
              StageShapes(kv, replace(state, num_layers=0))]
    plan = plan_stage_pools(stages, [64 << 20, 64 << 20], max_running=1000)
    assert plan.state_slots * stages[0].state.bytes_per_slot <= 32 << 20
    assert plan.kv_slots * stages[1].kv.bytes_per_token <= 64 << 20
    tight = plan_stage_pools(stages, [16 << 20, 64 << 20], max_running=1000)
    assert tight.max_running < plan.max_running


def _decode_batch():
    from batchinfer.engine.model_runner import DecodeRows, build_decode_batch

    rows = DecodeRows(token_ids=[1, 2, 3, 4, 5], positions=[0, 2, 1, 3, 0], state_slots=[4, 3, 2, 1, 0],
                      kv_indices=torch.arange(1 + 3 + 2 + 4 + 1), shared_with_prev=[0, 1, 1, 2, 0])
    return build_decode_batch(rows, replay=False, device=torch.device("cpu"))


def test_decode_micro_batches_keep_the_whole_context_and_absolute_offsets():
    batch = _decode_batch()
    parts = split_decode(batch, 2)
    assert [p.num_seqs for p in parts] == [2, 3]
    second = parts[1]
    assert second.kv_indptr.tolist() == [4, 6, 10, 11] and second.kv_indices is batch.kv_indices
    assert second.shared_with_prev.tolist() == [0, 2, 0] and second.logits_indices.tolist() == [0, 1, 2]
    assert torch.cat([p.input_ids for p in parts]).tolist() == [1, 2, 3, 4, 5]


def test_decode_micro_batch_cut_reads_nothing_on_the_host(monkeypatch):
    """A host read would stall the GPU each step and break CUDA-graph capture."""
    batch = _decode_batch()

    def host_read(*_args, **_kwargs):
        raise AssertionError("split_decode read a tensor on the host")

    for name in ("tolist", "item", "__int__", "__index__", "__bool__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    parts = split_decode(batch, 3)
    monkeypatch.undo()
    assert [p.num_seqs for p in parts] == [1, 2, 2]
