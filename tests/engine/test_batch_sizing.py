"""max_running sized from the model and the job's row lengths (cache/budget.size_max_running,
EngineConfig.row_tokens); a hand-set max_running still wins."""
from __future__ import annotations

import pytest
import torch

from batchinfer.cache.budget import MIN_SIZED_RUNNING, size_max_running
from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.engine.config import DEFAULT_MAX_RUNNING, DEFAULT_MAX_RUNNING_MOE, EngineConfig
from batchinfer.models.presets import preset_config

GIB = 2 ** 30


def _bytes(preset: str) -> tuple[int, int]:
    kv, state = shapes_from_model_config(preset_config(preset), torch.bfloat16, ring_len=16, ckpt_dtype=torch.bfloat16)
    return kv.bytes_per_token, state.bytes_per_slot


def test_27b_long_rows_get_the_best_measured_setting():
    """BENCHMARKS: 27B bf16 8,192 + 1,024 rows on one H200 ran 8,925 tok/s at 96, 8,375 at 256."""
    kv_token, state_slot = _bytes("qwen3.5-27b")
    assert kv_token == 64 * 1024 and 85 * 2**20 < state_slot < 90 * 2**20  # the figures the table was read with
    assert size_max_running(int(73.2 * GIB), kv_token, state_slot, 8192 + 1024, DEFAULT_MAX_RUNNING) == 96


def test_short_or_shared_rows_keep_the_models_cap():
    kv_token, state_slot = _bytes("qwen3.5-27b")
    assert size_max_running(int(73.2 * GIB), kv_token, state_slot, 300 + 32, DEFAULT_MAX_RUNNING) == 256
    kv_token, state_slot = _bytes("qwen3.5-35b-a3b")
    rows = size_max_running(100 * GIB, kv_token, state_slot, 1000 + 256, DEFAULT_MAX_RUNNING_MOE)
    assert rows == DEFAULT_MAX_RUNNING_MOE


def test_very_long_rows_stop_at_the_floor_and_values_are_coarse():
    kv_token, state_slot = _bytes("qwen3.5-27b")
    assert size_max_running(int(73.2 * GIB), kv_token, state_slot, 32768 + 32768, 256) == MIN_SIZED_RUNNING
    assert size_max_running(int(73.2 * GIB), kv_token, state_slot, 32768 + 32768, 16) == 16  # never above the cap
    for tokens in range(2000, 12000, 250):
        assert size_max_running(int(73.2 * GIB), kv_token, state_slot, tokens, 256) % 8 == 0
    with pytest.raises(ValueError):
        size_max_running(GIB, kv_token, state_slot, 0, 256)


def test_config_sizes_only_when_max_running_is_unset():
    kv_token, state_slot = _bytes("qwen3.5-27b")
    pools = (int(73.2 * GIB), kv_token, state_slot)
    dense, moe = preset_config("qwen3.5-27b"), preset_config("qwen3.5-35b-a3b")
    assert EngineConfig(row_tokens=9216).resolved_max_running(dense, pools) == 96
    assert EngineConfig(row_tokens=9216, max_running=200).resolved_max_running(dense, pools) == 200  # by hand: wins
    assert EngineConfig().resolved_max_running(dense, pools) == DEFAULT_MAX_RUNNING  # no lengths: the default
    assert EngineConfig(row_tokens=9216).resolved_max_running(moe) == DEFAULT_MAX_RUNNING_MOE  # no pools known
    with pytest.raises(ValueError):
        EngineConfig(row_tokens=0)


def test_engine_pools_follow_the_rows_lengths():
    from tests.engine_utils import make_engine, tiny_model

    model = tiny_model()
    default = make_engine(model, memory_budget_bytes=64 << 20)
    sized = make_engine(model, memory_budget_bytes=64 << 20, row_tokens=1500)
    plan = sized.pool_plan
    assert MIN_SIZED_RUNNING < plan.max_running < default.pool_plan.max_running == DEFAULT_MAX_RUNNING
    assert plan.max_running == size_max_running(64 << 20, plan.bytes_per_kv_token, plan.bytes_per_state_slot, 1500, 256)
    assert plan.kv_slots > default.pool_plan.kv_slots  # the states given up went to the KV
    assert plan.kv_slots >= 0.9 * plan.max_running * 1500  # every running row's KV fits
    assert sized.settings()["row_tokens"] == 1500 and sized.settings()["max_running_effective"] == plan.max_running
