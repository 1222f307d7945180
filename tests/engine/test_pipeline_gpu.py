"""Pipeline stages on one GPU with per-stage decode CUDA graphs: 2 stages both on cuda:0, graphs
captured, greedy tokens equal to the 1-stage engine's over 32 tokens, and the decode steps
replayed from the stage graphs (counted); the kernels precompiled as for one stage. Tiny preset, fp32, a small pool: well under a minute."""
from __future__ import annotations

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.stage_graphs import StageGraphs
from batchinfer.engine.types import SamplingParams
from batchinfer.models.pipeline import PipelinedModel
from tests.conftest import requires_cuda
from tests.engine_utils import requests_for, run, shared_prefix_prompts, tokens_of

pytestmark = [requires_cuda, pytest.mark.gpu]


def _engine(stages: int) -> Engine:
    config = EngineConfig(device="cuda:0", dtype="fp32", pipeline_stages=stages, max_running=8,
                          memory_budget_bytes=64 << 20, cuda_graphs=True)
    return Engine.from_pretrained("tiny", config, seed=1)


def test_two_stages_on_one_gpu_replay_stage_graphs_with_the_one_stage_tokens():
    requests = requests_for(shared_prefix_prompts(seed=2, groups=2, per_group=3, prefix_len=40),
                            SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    one = _engine(1)
    reference = tokens_of(run(one, requests))
    engine = _engine(2)
    assert (engine.precompile_report is None) == (one.precompile_report is None)  # traced through the stages
    assert isinstance(engine.model, PipelinedModel) and engine.model.devices == [engine.model.device] * 2
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture and isinstance(graphs.forward, StageGraphs)
    assert set(graphs.forward.graphs) == set(graphs.sizes)  # every bucket captured, per stage and micro-batch
    assert tokens_of(run(engine, requests)) == reference
    assert graphs.replays > 0  # decode steps came from the stage graphs (mixed steps run eagerly)
    busy = engine.model.stage_busy_seconds()
    assert len(busy) == 2 and all(b > 0 for b in busy)
