"""The engine on CUDA with the Triton kernels: decode CUDA graphs, reuse, cache-hit parity."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batchinfer.engine.planner import make_plan
from batchinfer.engine.types import SamplingParams
from batchinfer.models.presets import preset_config, random_model
from tests.conftest import requires_cuda
from tests.engine_utils import make_engine, requests_for, run, shared_prefix_prompts, tokens_of

pytestmark = [requires_cuda, pytest.mark.gpu]


@pytest.fixture(scope="module")
def model():
    return random_model(preset_config("tiny"), torch.float32, "cuda", seed=1)


@pytest.fixture(scope="module")
def requests():
    return requests_for(shared_prefix_prompts(seed=2), SamplingParams(max_tokens=24, ignore_eos=True))


def _engine(model, **settings):
    return make_engine(model, device="cuda", memory_budget_bytes=64 << 20, **settings)


def test_graphs_and_cache_keep_greedy_tokens(model, requests):
    reference = tokens_of(run(_engine(model, prefix_cache=False, replayssm=False, cuda_graphs=False,
                                      overlap_decode=False), requests))
    for settings in (dict(cuda_graphs=True), dict(cuda_graphs=False), dict(cuda_graphs=True, max_running=3),
                     dict(cuda_graphs=True, overlap_decode=False)):
        engine = _engine(model, **settings)
        assert (engine.runner.decode_graphs is not None) == settings["cuda_graphs"]
        outputs = run(engine, requests)
        assert tokens_of(outputs) == reference, settings
        ideal = make_plan([r.prompt_token_ids for r in requests]).summary.theoretical_max_cached_tokens
        assert engine.stats.cached_tokens == ideal


def test_bf16_sampled_run_is_reproducible(requests):
    model = random_model(preset_config("tiny"), torch.bfloat16, "cuda", seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5, n=2)
    sampled = [replace(r, sampling=params) for r in requests]
    first = tokens_of(run(make_engine(model, device="cuda", dtype="bf16", memory_budget_bytes=64 << 20), sampled))
    again = tokens_of(run(make_engine(model, device="cuda", dtype="bf16", memory_budget_bytes=64 << 20), sampled))
    assert first == again
