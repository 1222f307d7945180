"""Engine end to end on a tiny random model (fp32, CPU): the same greedy tokens whatever the
cache, ReplaySSM, batching or memory pressure, and reuse equal to the planner's ideal."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from batchinfer.engine.cuda_graphs import DecodeGraphs
from batchinfer.engine.planner import make_plan
from batchinfer.engine.types import SamplingParams
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.presets import PRESETS, random_model
from batchinfer.cache.shapes import shapes_from_model_config
from tests.engine_utils import TINY_VOCAB, make_engine, requests_for, run, shared_prefix_prompts, tiny_model, tokens_of

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SAMPLES = {3: 2}  # request 3 asks for two (greedy, hence identical) samples


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


@pytest.fixture(scope="module")
def workload():
    prompts = shared_prefix_prompts(seed=2)
    return prompts, requests_for(prompts, GREEDY, n_of=lambda i: SAMPLES.get(i, 1))


@pytest.fixture(scope="module")
def reference(model, workload):
    """No prefix cache, recurrent decode, one step at a time: every token computed from scratch."""
    engine = make_engine(model, prefix_cache=False, replayssm=False, overlap_decode=False)
    outputs = run(engine, workload[1])
    assert all(out.cached_tokens == 0 for out in outputs.values())
    return tokens_of(outputs)


@pytest.mark.parametrize("settings", [
    dict(),                                        # extra_buffer + ReplaySSM, max_running 256
    dict(max_running=1),
    dict(replayssm=False, max_batch_tokens=50),    # prefill split across steps
    dict(ring_len=3, max_running=5, track_interval=16),
], ids=["default", "max_running_1", "no_replay_chunked", "ring3_running5"])
def test_reuse_equals_plan_and_tokens_equal_recompute(model, workload, reference, settings):
    prompts, requests = workload
    engine = make_engine(model, **settings)
    outputs = run(engine, requests)
    assert tokens_of(outputs) == reference
    plan = make_plan(prompts, [SAMPLES.get(i, 1) for i in range(len(prompts))])
    ideal = plan.summary.theoretical_max_cached_tokens
    assert ideal > 0
    for out in outputs.values():
        assert out.cached_tokens == out.theoretical_max_cached_tokens, out
    stats = engine.stats
    assert stats.cached_tokens == stats.theoretical_max_cached_tokens == ideal
    assert stats.prompt_tokens == plan.summary.prompt_tokens
    assert stats.output_tokens == 6 * len(reference) and stats.requests == len(reference)
    assert stats.preemptions == 0 and stats.discarded_kv_tokens == 0
    if engine.config.replayssm:
        assert stats.replayssm_flushes > 0  # 6 decode steps through rings of 3-4 entries


def test_samples_of_one_prompt_share_all_but_the_last_token(model, workload, reference):
    engine = make_engine(model)
    outputs = run(engine, workload[1])
    first, second = outputs[(3, 0)], outputs[(3, 1)]
    assert first.token_ids == second.token_ids  # greedy
    assert sorted([first.cached_tokens, second.cached_tokens])[1] == first.prompt_tokens - 1


@pytest.mark.slow
@pytest.mark.parametrize("max_running", [256, 1])
def test_no_buffer_reuses_less_and_keeps_tokens(model, workload, reference, max_running):
    engine = make_engine(model, state_cache="no_buffer", max_running=max_running)
    outputs = run(engine, workload[1])
    assert tokens_of(outputs) == reference
    stats = engine.stats
    assert stats.cached_tokens < stats.theoretical_max_cached_tokens
    assert stats.states_tracked == 0
    if max_running == 1:
        # Leaders finish before followers start: the shared prefix's KV matches, but the only
        # state lies at the leader's end, so the KV hit is thrown away.
        assert stats.discarded_kv_tokens > 0


def test_plan_windows_keep_tokens_and_still_reuse(model, workload, reference):
    engine = make_engine(model, plan_window=4)
    outputs = run(engine, workload[1])
    assert tokens_of(outputs) == reference
    assert 0 < engine.stats.cached_tokens


@pytest.mark.slow
def test_memory_pressure_forces_eviction_and_preemption():
    # Two attention layers of four: KV is dear next to the GDN states, so a small budget holds
    # the states of 4 running requests but less KV than they grow to over 40 output tokens.
    config = model_config_from_dict({**PRESETS["tiny"], "full_attention_interval": 2})
    model = random_model(config, torch.float32, "cpu", seed=3)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, top_k=40, seed=3)
    # Request 0 is greedy, the rest sample: a preempted sample must redraw the same tokens.
    requests = [replace(r, sampling=sampled) if r.request_id else r
                for r in requests_for(shared_prefix_prompts(seed=5), greedy)]
    reference = tokens_of(run(make_engine(model, prefix_cache=False, replayssm=False, overlap_decode=False), requests))
    engine = make_engine(model, memory_budget_bytes=540_000, max_running=64)
    drains, schedule_rest = [], engine.scheduler.schedule_rest  # called once the step in flight was read
    engine.scheduler.schedule_rest = lambda plan: drains.append(engine.overlap.step is None) or schedule_rest(plan)
    assert engine.pool_plan.kv_slots < 300
    preempted, preempt = [], engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: preempted.append(seq.request.sampling.temperature) or preempt(seq)
    assert tokens_of(run(engine, requests)) == reference
    stats = engine.stats
    assert stats.preemptions > 0 and stats.recomputed_tokens > 0
    assert 1.0 in preempted  # a sampled request was recomputed
    assert any(drains)  # decode steps were in flight when memory ran out: read first, then preempt
    assert engine.cache.stats().kv_evicted_tokens > 0 and stats.states_evicted > 0
    assert stats.cached_tokens <= stats.theoretical_max_cached_tokens


def test_a_budget_below_max_running_is_reported(caplog):
    model = random_model(model_config_from_dict(PRESETS["tiny"]), torch.float32, "cpu", seed=0)
    with caplog.at_level("WARNING", logger="batchinfer.engine.engine"):
        small = make_engine(model, memory_budget_bytes=540_000, max_running=64)
    assert small.pool_plan.max_running < 64
    assert f"fits {small.pool_plan.max_running} concurrent requests, not max_running=64" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="batchinfer.engine.engine"):
        make_engine(model, max_running=2)
    assert "concurrent requests" not in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("ctx_cap", [128, 80])  # 80: some steps do not fit and run eagerly
def test_padded_static_decode_buffers_give_the_same_tokens(model, workload, reference, ctx_cap):
    """The CUDA-graph path's buffers and padding rows, run without capture on the CPU."""
    engine = make_engine(model, max_running=5)
    pools = engine.cache
    graphs = DecodeGraphs(model, engine.runner.caches, engine.device, replay=True, max_batch=5,
                          pad_state_slot=pools.state_pool.pad_slot, pad_kv_slot=pools.kv_pool.pad_slot,
                          ctx_cap=ctx_cap, capture=False)
    assert graphs.sizes == [1, 2, 4, 5]
    fits = []
    static_run = graphs.run

    def counting_run(*args, **kwargs):
        logits = static_run(*args, **kwargs)
        fits.append(logits is not None)
        if logits is not None:  # every bucket writes the head of the one shared buffer
            assert logits.data_ptr() == graphs.logits.data_ptr()
        return logits

    graphs.run = counting_run
    engine.runner.decode_graphs = graphs
    assert tokens_of(run(engine, workload[1])) == reference
    assert any(fits) and (all(fits) if ctx_cap == 128 else not all(fits))


@pytest.mark.parametrize("ring_len,max_tokens", [(4, 12), (3, 7), (5, 5)])
def test_replayssm_flushes_count_full_rings(model, ring_len, max_tokens):
    # The first token comes from prefill; decode step k (0-based) finds a full ring when k is
    # a positive multiple of ring_len.
    engine = make_engine(model, ring_len=ring_len)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    run(engine, requests_for(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    decode_steps = max_tokens - 1
    assert engine.stats.replayssm_flushes == len(prompts) * ((decode_steps - 1) // ring_len)


@pytest.mark.parametrize("n", [3, 7])
def test_budget_for_n_working_slots_runs_n_at_once_with_ideal_reuse(model, workload, reference, n):
    """A state share of exactly n working slots + the minimum cache pool (8 states): n requests
    run at once — under the old 3 slots per request + 1 cached + 16 path states, (n + 8) slots
    held 2 at most — tokens stay those of a from-scratch run and reuse stays the plan's ideal,
    although tracking keeps evicting cached states (locked paths' included) to find slots."""
    prompts, requests = workload
    _, state_shape = shapes_from_model_config(model.config, torch.float32, ring_len=4, ckpt_dtype=torch.float32)
    engine = make_engine(model, memory_budget_bytes=2 * (n + 8) * state_shape.bytes_per_slot + 1, max_running=64)
    assert (engine.pool_plan.max_running, engine.pool_plan.state_slots) == (n, n + 8)
    running_sizes, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        running_sizes.append(len(engine.scheduler.running))
        assert all(len(seq.handle.state_slots()) == 1 for seq in engine.scheduler.running)  # no track slots
        return plan

    engine.scheduler.schedule = recording_schedule
    outputs = run(engine, requests)
    assert max(running_sizes) == n
    assert tokens_of(outputs) == reference
    stats = engine.stats
    assert stats.cached_tokens == stats.theoretical_max_cached_tokens > 0
    assert stats.states_evicted > 0 and engine.cache.stats().tracks_skipped == 0 and stats.preemptions == 0


def _grouped_prompts(groups: int, per_group: int, prefix_len: int, suffix_len: int, seed: int):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(TINY_VOCAB) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(TINY_VOCAB) for _ in range(suffix_len)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


@pytest.mark.parametrize("max_running", [8, 16, 48])
def test_branch_states_outlive_state_pool_pressure(model, max_running):
    """16 groups × 4 prompts, a state tracked every 16 tokens: the working slots leave the state
    pool only its cached share (8, 8, 12 slots), which interval tracks keep churning. A branch
    state whose followers wait for a running place must stay until they are admitted (8: reuse
    was 0 of 3,072 tokens without that), and leaders of more groups than the share can hold
    must wait their turn (16: reuse was 1,664 without that)."""
    prompts = _grouped_prompts(16, 4, 64, 33, seed=3)
    requests = requests_for(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    engine = make_engine(model, memory_budget_bytes=64 << 20, max_running=max_running, track_interval=16)
    assert engine.pool_plan.max_running == max_running
    outputs = run(engine, requests)
    stats = engine.stats
    assert stats.cached_tokens == stats.theoretical_max_cached_tokens > 3000
    assert stats.states_evicted > 0 and stats.discarded_kv_tokens == 0
    reference = make_engine(model, prefix_cache=False, replayssm=False, overlap_decode=False)
    assert tokens_of(outputs) == tokens_of(run(reference, requests))


def test_branch_gating_never_stalls_nested_plans(model, workload, reference):
    """A pace of one live branch state, 3 running: nested branches (a prompt extending a
    whole earlier prompt, one sharing half a prefix) must still run to the end with the
    from-scratch tokens — the head of the plan may always open branches, and a follower
    that closes one is never held back by the pace."""
    prompts, requests = workload
    engine = make_engine(model, max_running=3)
    engine.scheduler.branch_state_capacity = 1
    steps, step = [0], engine._step

    def counted_step():
        steps[0] += 1
        assert steps[0] < 5000, "the scheduler stopped making progress"
        return step()

    engine._step = counted_step
    assert tokens_of(run(engine, requests)) == reference
    assert engine.stats.cached_tokens == engine.stats.theoretical_max_cached_tokens > 0
