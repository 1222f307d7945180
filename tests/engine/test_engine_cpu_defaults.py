"""On the CPU an unset max_running is sized to the memory budget without a warning; a job that sets
it is told when the budget fits fewer."""
from __future__ import annotations

import torch

from batchinfer.engine.startup import max_running_shortfall
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.presets import PRESETS, random_model
from tests.engine_utils import make_engine, tiny_moe_model


def test_the_default_max_running_is_sized_to_the_cpu_budget_silently(caplog):
    model = random_model(model_config_from_dict(PRESETS["tiny"]), torch.float32, "cpu", seed=0)
    with caplog.at_level("WARNING", logger="batchinfer.engine.engine"):
        engine = make_engine(model, memory_budget_bytes=540_000)
    assert engine.pool_plan.max_running < 256
    assert "concurrent requests" not in caplog.text
    with caplog.at_level("WARNING", logger="batchinfer.engine.engine"):
        make_engine(model, memory_budget_bytes=540_000, max_running=256)  # set by the job: said
    assert "not max_running=256" in caplog.text


def test_only_a_max_running_the_job_set_warns():
    assert not max_running_shortfall(166, None, 256, "cpu")
    assert max_running_shortfall(166, 256, 256, "cpu")
    assert not max_running_shortfall(166, None, 1024, "cuda")  # the default sizes itself to the memory
    assert max_running_shortfall(166, 256, 256, "cuda")
    assert not max_running_shortfall(256, 256, 256, "cuda")


def test_the_default_max_running_suits_the_model():
    from batchinfer.engine.config import DEFAULT_MAX_RUNNING, DEFAULT_MAX_RUNNING_MOE, EngineConfig
    from batchinfer.models.config import model_config_from_dict
    from batchinfer.models.presets import PRESETS
    dense, moe = (model_config_from_dict(PRESETS[name]) for name in ("qwen3.5-27b", "qwen3.5-35b-a3b"))
    assert EngineConfig().resolved_max_running(dense) == DEFAULT_MAX_RUNNING == 256
    assert EngineConfig().resolved_max_running(moe) == DEFAULT_MAX_RUNNING_MOE == 1024
    assert EngineConfig(max_running=48).resolved_max_running(moe) == 48


def test_the_default_step_size_is_the_large_one_and_a_set_one_wins():
    from batchinfer.engine.config import DEFAULT_MAX_BATCH_TOKENS, FALLBACK_MAX_BATCH_TOKENS, EngineConfig
    assert EngineConfig().resolved_max_batch_tokens() == DEFAULT_MAX_BATCH_TOKENS == 32768
    assert FALLBACK_MAX_BATCH_TOKENS == 8192
    assert EngineConfig(max_batch_tokens=4096).resolved_max_batch_tokens() == 4096


def test_the_engine_steps_by_the_default_unless_the_job_sets_it():
    dense = random_model(model_config_from_dict(PRESETS["tiny"]), torch.float32, "cpu", seed=0)
    assert make_engine(dense).scheduler.max_batch_tokens == 32768
    assert make_engine(dense, max_batch_tokens=8192).scheduler.max_batch_tokens == 8192
    assert make_engine(tiny_moe_model()).scheduler.max_batch_tokens == 32768
    assert make_engine(tiny_moe_model(), max_batch_tokens=64).scheduler.max_batch_tokens == 64
    assert make_engine(tiny_moe_model()).settings()["max_batch_tokens"] == 32768  # stats.json says what ran
