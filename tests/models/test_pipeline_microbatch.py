"""Prefill micro-batches of a pipelined model (CPU, fp32): the cut by sequences balanced by
tokens, and a micro-batched prefill giving the whole model's logits and cache contents."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from batchinfer.cache.kv_pool import KVPool
from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.cache.state_pool import GdnStatePool
from batchinfer.engine.model_runner import SequenceChunk, build_forward_batch
from batchinfer.engine.pipeline_pools import build_pipeline_pools
from batchinfer.models.forward_batch import ModelCaches
from batchinfer.models.micro_batches import prefill_edges, split_prefill
from batchinfer.models.pipeline import StagedCaches
from batchinfer.models.pipeline_build import random_pipelined_model
from batchinfer.models.presets import preset_config, random_model

CPU = torch.device("cpu")


def test_prefill_edges_balance_tokens_and_never_cut_a_sequence():
    assert prefill_edges([0, 10, 20, 30, 40], 2) == [0, 2, 4]
    assert prefill_edges([0, 1000, 1001, 1002], 2) == [0, 1, 3]  # the long one alone, whole
    assert prefill_edges([0, 5, 105], 4) == [0, 1, 2]            # fewer sequences than parts
    assert prefill_edges([0, 7], 3) == [0, 1]


def _chunks():
    """Three sequences in state slots 2, 0, 1; the last a chunk that ends before its last token."""
    lengths, logits = [5, 4, 9], [True, True, False]
    chunks, kv = [], 0
    for n, (slot, wants) in zip(lengths, zip((2, 0, 1), logits)):
        tokens = [(7 * slot + 3 * i) % 500 + 1 for i in range(n)]
        chunks.append(SequenceChunk(tokens, 0, slot, torch.arange(kv, kv + n), wants))
        kv += n
    return chunks


def test_micro_batched_prefill_gives_the_whole_models_logits_and_caches():
    config = preset_config("tiny")
    whole = random_model(config, torch.float32, CPU, seed=2)
    staged = random_pipelined_model(config, torch.float32, [CPU, CPU], seed=2)
    kv_shape, state_shape = shapes_from_model_config(config, torch.float32)
    kv, states = KVPool(64, kv_shape), GdnStatePool(4, state_shape)
    kv_st, states_st = build_pipeline_pools(staged, SimpleNamespace(kv_slots=64, state_slots=4), kv_shape, state_shape)
    batch = build_forward_batch(_chunks(), is_decode=False, replay=False, device=CPU)

    micro = split_prefill(batch, 2)
    assert [m.num_seqs for m in micro] == [2, 1] and [m.logits_indices.tolist() for m in micro] == [[4, 8], []]
    assert micro[1].cu_seqlens.tolist() == [0, 9] and micro[1].kv_indptr.tolist() == [9, 18]
    runs = []
    for stage in staged.stages:
        run = stage.run
        stage.run = lambda b, c, carry, _run=run: (runs.append(b.num_seqs), _run(b, c, carry))[1]

    expected = whole.forward(batch, ModelCaches.from_pools(kv, states))
    got = staged.forward(batch, StagedCaches.from_pools(kv_st, states_st))
    assert runs == [2, 1, 2, 1]  # wavefront: stage 0 runs micro-batch 1 beside stage 1 on micro-batch 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    k_stage = [k for pool in kv_st.stages for k in pool.k]
    ssm_stage = [s for pool in states_st.stages for s in pool.ssm]
    for a, b in zip(kv.k, k_stage):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(states.ssm, ssm_stage):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
