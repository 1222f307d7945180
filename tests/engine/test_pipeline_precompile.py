"""The precompile's trace in pipeline mode (CPU parts): it runs through the stages, reads every
stage's pool shapes, and is keyed apart from the whole model's trace and from other splits (a
manifest of the whole model's shapes would miss the micro-batch kernels)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.engine.build import staged_trace
from batchinfer.engine.pipeline_pools import build_pipeline_pools
from batchinfer.engine.step_shapes import StepShapes, engine_trace, trace_parts
from batchinfer.models.forward_batch import allocate_caches
from batchinfer.models.pipeline import StagedCaches
from batchinfer.models.pipeline_build import random_pipelined_model
from batchinfer.models.presets import preset_config, random_model

CPU = torch.device("cpu")
SHAPES = StepShapes(decode_buckets=[1, 2, 4], graph_ctx_cap=16, decode_hint=True, max_batch_tokens=64,
                    max_running=4, max_model_len=64, replay=True)


def _staged(stages: int):
    config = preset_config("tiny")
    model = random_pipelined_model(config, torch.float32, [CPU] * stages, seed=0)
    kv_shape, state_shape = shapes_from_model_config(config, torch.float32, ring_len=4, ckpt_dtype=torch.float32)
    kv_pool, state_pool = build_pipeline_pools(model, SimpleNamespace(kv_slots=32, state_slots=4), kv_shape, state_shape)
    return model, StagedCaches.from_pools(kv_pool, state_pool), kv_pool, state_pool


def test_the_trace_key_reads_every_stages_pools_and_tells_splits_apart():
    config = preset_config("tiny")
    whole = random_model(config, torch.float32, CPU, seed=0)
    whole_caches = allocate_caches(config, 4, 32, torch.float32, CPU, replay_ring_len=4)
    whole_key = engine_trace(whole, whole_caches, SHAPES, 4, 32, CPU).key
    keys = set()
    for stages in (2, 4):
        model, caches, kv_pool, state_pool = _staged(stages)
        assert len(caches.ssm) == len(config.gdn_layer_ids) and len(caches.kv_k) == len(config.attn_layer_ids)
        assert trace_parts(model, caches, SHAPES, CPU)[3] == trace_parts(whole, whole_caches, SHAPES, CPU)[3]
        trace = staged_trace(engine_trace(model, caches, SHAPES, state_pool.pad_slot, kv_pool.pad_slot, CPU), model)
        keys.add(trace.key)
    assert len(keys) == 2 and whole_key not in keys


def test_busy_time_of_the_trace_is_forgotten():
    model, caches, kv_pool, state_pool = _staged(2)
    model.add_busy(0, 1.5)
    model.reset_busy()
    assert model.stage_busy_seconds() == [0.0, 0.0]


def test_the_trace_runs_every_step_through_the_stages(monkeypatch, caplog):
    """Every traced step (decode buckets, prefill batches) runs through the pipelined model without
    the trace's failure warning (on the CPU the kernels' reference code runs; no CUDA sync)."""
    model, caches, kv_pool, state_pool = _staged(2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    ran = []
    for stage in model.stages:
        run = stage.run
        stage.run = lambda b, c, carry, _run=run: (ran.append(b.is_decode), _run(b, c, carry))[1]
    trace = engine_trace(model, caches, SHAPES, state_pool.pad_slot, kv_pool.pad_slot, CPU)
    with caplog.at_level("WARNING"):
        trace.run()
    assert "precompile trace" not in caplog.text
    assert True in ran and False in ran
