"""A MoE model's larger default step (32,768 tokens) only where its activations leave the pools
most of their memory: on one H200 the FP8 35B-A3B keeps it, the FP8 122B-A10B (115 GiB of
weights) steps down to 8,192, and a step size the job set is never changed."""
from __future__ import annotations

import pytest
import torch

from batchinfer.cache.budget import pool_budget
from batchinfer.engine import build
from batchinfer.engine.build import EngineBuilder, activation_reserve_bytes, larger_step_fits
from batchinfer.engine.config import EngineConfig
from batchinfer.models.fp8_model import written_fp8_params
from batchinfer.models.presets import preset_config
from batchinfer.models.qwen3_hybrid import HybridModel

H200_BYTES = 139 * 2**30  # what a process sees of one H200


def _pools_on_one_h200(preset: str, tokens: int) -> int:
    config = preset_config(preset)
    weights = sum(p.numel() * p.element_size()
                  for p in HybridModel(config, torch.bfloat16, "meta", written_fp8_params(config)).parameters())
    engine = EngineConfig(dtype="bf16", row_tokens=9216)
    return pool_budget(H200_BYTES - weights, engine.memory_fraction,
                       activation_reserve_bytes(config, engine, 9216 + 16, tokens))


@pytest.mark.parametrize("preset, keeps", [("qwen3.5-35b-a3b", True), ("qwen3.5-122b-a10b", False)])
def test_the_larger_step_fits_one_h200_for_the_35b_not_the_122b(preset, keeps):
    assert larger_step_fits(_pools_on_one_h200(preset, 8192), _pools_on_one_h200(preset, 32768)) is keeps


def _builder(model_config, config: EngineConfig, pools: dict[int, int]) -> EngineBuilder:
    """An EngineBuilder as far as `_step_tokens` reads it, on a pretend GPU whose pools beside a
    step of T tokens are pools[T] (a missing T: its activations exceed the free memory)."""
    builder = object.__new__(EngineBuilder)
    builder.model = type("Model", (), {"config": model_config})()
    builder.config, builder.device, builder.pipelined = config, torch.device("cuda"), False

    def budget(tokens=None):
        if tokens not in pools:
            raise ValueError("the activations alone exceed the free memory")
        return pools[tokens]
    builder._budget_bytes = budget
    return builder


def test_the_builder_steps_down_only_a_default_that_crowds_the_pools(caplog):
    moe, dense = preset_config("qwen3.5-35b-a3b"), preset_config("qwen3.5-27b")
    ample, tight = {8192: 100 << 30, 32768: 96 << 30}, {8192: 18 << 30, 32768: 12 << 30}
    assert _builder(moe, EngineConfig(), ample)._step_tokens() == 32768
    with caplog.at_level("INFO", logger=build.log.name):
        assert _builder(moe, EngineConfig(), tight)._step_tokens() == 8192
    assert "max_batch_tokens 8192" in caplog.text
    assert _builder(moe, EngineConfig(), {8192: 18 << 30})._step_tokens() == 8192  # 32,768 does not fit at all
    assert _builder(moe, EngineConfig(max_batch_tokens=32768), tight)._step_tokens() == 32768  # the job's own
    assert _builder(dense, EngineConfig(), ample)._step_tokens() == 32768  # one default for dense and MoE
    assert _builder(dense, EngineConfig(), tight)._step_tokens() == 8192
    cpu = _builder(dense, EngineConfig(), {})
    cpu.device = torch.device("cpu")  # no free-memory query there: the default as asked
    assert cpu._step_tokens() == 32768
    assert _builder(moe, EngineConfig(memory_budget_bytes=1 << 30), {})._step_tokens() == 32768  # a fixed budget
