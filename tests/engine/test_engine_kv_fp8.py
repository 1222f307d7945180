"""An FP8 KV pool (`kv_cache_dtype: fp8_e4m3`): the engine stores and reads it, generates the same
greedy tokens as the model-dtype pool on the tiny model (prefix sharing included), and fits more
KV positions in the same memory."""
from __future__ import annotations

import random

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.presets import PRESETS, random_model
from tests.engine_utils import make_engine


@pytest.fixture(scope="module")
def model():
    return random_model(model_config_from_dict(PRESETS["tiny"]), torch.float32, "cpu", seed=0)


def _prompts(vocab: int) -> list[tuple[int, ...]]:
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(vocab) for _ in range(40)) for _ in range(4)]
    return prompts + [prompts[0][:30] + tuple(rng.randrange(vocab) for _ in range(10))]  # a shared prefix


def _greedy(engine, prompts) -> list[tuple[int, ...]]:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {o.request_id: o.token_ids for o in engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])}
    return [tuple(outs[i]) for i in range(len(prompts))]


def test_fp8_kv_generates_the_model_dtype_pools_greedy_tokens(model):
    prompts = _prompts(model.config.vocab_size)
    full = make_engine(model)
    fp8 = make_engine(model, kv_cache_dtype="fp8_e4m3")
    assert fp8.cache.kv_pool.k[0].dtype == torch.float8_e4m3fn and full.cache.kv_pool.k[0].dtype == torch.float32
    assert _greedy(fp8, prompts) == _greedy(full, prompts)
    assert fp8.stats.cached_tokens > 0  # the shared prefix was read back from the FP8 pool
    assert fp8.settings()["kv_cache_dtype"] == "fp8_e4m3"


def test_fp8_kv_holds_more_positions_in_the_same_memory(model):
    full = make_engine(model, max_running=4)
    fp8 = make_engine(model, max_running=4, kv_cache_dtype="fp8_e4m3")
    assert fp8.pool_plan.kv_slots > 2 * full.pool_plan.kv_slots  # 1 byte a value against fp32's 4


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    assert EngineConfig().resolved_kv_dtype() == EngineConfig().resolved_dtype()
