"""Pipeline stages through the engine (CPU, fp32): greedy tokens of 1, 2 and 4 stages identical on a
dense and a MoE tiny checkpoint (eagerly and through the per-stage decode graphs' path, prefill
micro-batches on), prefix reuse = the plan's ideal, each stage holding only its layers."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.stage_graphs import stage_decode_graphs
from batchinfer.engine.types import SamplingParams
from batchinfer.models.checkpoint_writer import write_random_checkpoint
from batchinfer.models import pipeline as pipeline_module
from batchinfer.models.micro_batches import split_prefill
from batchinfer.models.pipeline import PipelinedModel
from batchinfer.models.presets import PRESETS
from tests.engine_utils import requests_for, run, shared_prefix_prompts

MOE = {**PRESETS["tiny"], "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
       "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}


def _tokens(path, stages: int, graphs: bool = False, copy_hand_over: bool = False):
    """Greedy tokens of an engine of `stages` stages; `graphs`: decode steps through the per-stage
    graph path (its static buffers and padding, run without capture on the CPU)."""
    config = EngineConfig(device="cpu", dtype="fp32", memory_budget_bytes=16 << 20, ring_len=4, track_interval=32,
                          pipeline_stages=stages)
    engine = Engine.from_pretrained(str(path), config)
    if graphs:
        cache = engine.cache
        engine.runner.decode_graphs = stage_decode_graphs(
            engine.model, engine.runner.caches, engine.device, replay=engine.runner.replay,
            max_batch=engine.pool_plan.max_running, kv_pool=cache.kv_pool, state_pool=cache.state_pool, ctx_cap=128,
            capture=False, copy_hand_over=copy_hand_over)
    outputs = run(engine, requests_for(shared_prefix_prompts(groups=2, per_group=3, prefix_len=40), SamplingParams(max_tokens=6, temperature=0.0)))
    if graphs:
        assert engine.runner.decode_graphs.replays > 0  # decode steps took the graph path
    return engine, {key: tuple(out.token_ids) for key, out in outputs.items()}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_tokens_identical_over_1_2_4_stages(tmp_path, kind, monkeypatch):
    path = write_random_checkpoint(tmp_path / kind, PRESETS["tiny"] if kind == "dense" else MOE, seed=1)
    _, reference = _tokens(path, 1)
    prefill_cuts = []

    def recording_split(batch, parts):
        micro = split_prefill(batch, parts)
        prefill_cuts.append(len(micro))
        return micro

    monkeypatch.setattr(pipeline_module, "split_prefill", recording_split)
    for stages in (2, 4):
        prefill_cuts.clear()
        engine, tokens = _tokens(path, stages)
        assert isinstance(engine.model, PipelinedModel) and engine.model.num_stages == stages
        assert tokens == reference, f"{stages} stages"
        assert max(prefill_cuts) > 1  # prefill steps of several sequences ran as micro-batches
        stats = engine.stats
        assert stats.cached_tokens == stats.theoretical_max_cached_tokens > 0
        pipeline = engine.settings()["pipeline"]  # what _stats.json's engine_settings holds
        assert pipeline["stages"] == [list(b) for b in engine.model.split.bounds]
        assert len(pipeline["stage_busy_seconds"]) == stages and all(b > 0 for b in pipeline["stage_busy_seconds"])
        _check_stages_hold_their_own(engine)
        assert _tokens(path, stages, graphs=True)[1] == reference, f"{stages} stages, graph path"
    assert _tokens(path, 2, graphs=True, copy_hand_over=True)[1] == reference  # as across devices


def _check_stages_hold_their_own(engine):
    """Each stage: only its layers' weights (embedding first, LM head last), its layers' pools."""
    model = engine.model
    last = model.num_stages - 1
    for s, stage in enumerate(model.stages):
        names = {name.split(".")[1] for name, _ in stage.named_parameters() if name.startswith("layers.")}
        assert names == {str(i) for i in model.split.layers(s)}
        assert (stage.embed is not None) == (s == 0) and (stage.lm_head is not None) == (s == last)
    kv, states = engine.cache.kv_pool, engine.cache.state_pool
    assert [len(p.k) for p in kv.stages] == [stage.num_attn_layers for stage in model.stages]
    assert [len(p.ssm) for p in states.stages] == [stage.num_gdn_layers for stage in model.stages]
    assert sum(len(p.ssm) for p in states.stages) == 3 and sum(len(p.k) for p in kv.stages) == 1
