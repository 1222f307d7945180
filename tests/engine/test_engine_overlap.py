"""Decode overlap: the next decode step is launched before the host reads this step's tokens.

The host then learns of a stop one step late, so a finished sequence is fed its stop token
once more; that extra step's KV and state must be exactly what caching keeps, and nothing a
later request reuses may differ from a run that reads every step at once (`overlap_decode=False`)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batchinfer.engine import draws as draws_module
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.presets import PRESETS, random_model
from batchinfer.engine.types import Request, SamplingParams
from tests.engine_utils import make_engine, requests_for, run, shared_prefix_prompts, tiny_model, tokens_of


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=6, groups=2, per_group=3, prefix_len=40)


def _stop_tokens(model, prompts) -> tuple[int, int]:
    """Two token ids that greedy decoding emits early for some prompts but not all: as EOS they
    end sequences at different steps (the overlap's stop-one-step-late path)."""
    plain = run(make_engine(model, overlap_decode=False),
                requests_for(prompts, SamplingParams(max_tokens=8, ignore_eos=True)))
    counts: dict[int, int] = {}
    for out in plain.values():
        for t in set(out.token_ids[1:5]):
            counts[t] = counts.get(t, 0) + 1
    common = sorted(counts, key=lambda t: -counts[t])
    assert len(common) >= 2
    return common[0], common[1]


def _outputs(model, requests, eos, **settings):
    """The engine (after the run) and its outputs; `engine.fed_past_stop` counts sequences that
    finished with their stop token already fed (the step after it was in flight)."""
    engine = make_engine(model, **settings)
    engine.stop_rules = replace(engine.stop_rules, eos_token_ids=frozenset(eos))
    engine.fed_past_stop, finish = 0, engine.scheduler.finish

    def counting_finish(seq):
        engine.fed_past_stop += seq.computed == len(seq.tokens)
        finish(seq)

    engine.scheduler.finish = counting_finish
    return engine, run(engine, requests)


@pytest.mark.parametrize("state_cache", ["extra_buffer", "no_buffer"])
@pytest.mark.parametrize("replayssm", [True, False])
def test_stops_in_flight_give_the_same_outputs_and_cache(model, prompts, state_cache, replayssm):
    eos = _stop_tokens(model, prompts)
    requests = requests_for(prompts, SamplingParams(max_tokens=10))
    settings = dict(state_cache=state_cache, replayssm=replayssm, max_running=5)
    plain_engine, plain = _outputs(model, requests, eos, overlap_decode=False, **settings)
    engine, overlapped = _outputs(model, requests, eos, **settings)
    assert {k: (o.token_ids, o.finish_reason, o.cached_tokens) for k, o in overlapped.items()} == \
        {k: (o.token_ids, o.finish_reason, o.cached_tokens) for k, o in plain.items()}
    reasons = {o.finish_reason for o in overlapped.values()}
    assert reasons == {"stop", "length"}, reasons  # both kinds of stop happened
    assert engine.fed_past_stop > 0 and plain_engine.fed_past_stop == 0

    # Follow-up prompts extend finished ones past their stop token: they resume from what the
    # cache kept of the first round — including the extra step fed while the stop was in flight.
    follow = [Request(100 + i, tuple(prompts[k[0]]) + out.token_ids + (7, 8, 9), SamplingParams(max_tokens=4))
              for i, (k, out) in enumerate(sorted(overlapped.items()))]
    reused = run(engine, follow)
    fresh = run(make_engine(model, prefix_cache=False, replayssm=False, overlap_decode=False), follow)
    assert tokens_of(reused) == tokens_of(fresh)
    assert sum(o.cached_tokens for o in reused.values()) > 0


def test_steps_are_read_one_launch_late(model, prompts, monkeypatch):
    """The host reads step k's tokens only after launching step k + 1 (then the GPU never idles
    on host bookkeeping); with overlap off it reads each step before the next launch."""
    events = []

    class RecordingDownload(draws_module.Download):
        def tolist(self):
            events.append("read")
            return super().tolist()

    monkeypatch.setattr(draws_module, "Download", RecordingDownload)
    requests = requests_for(prompts[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    for overlap in (True, False):
        events.clear()
        engine = make_engine(model, overlap_decode=overlap)
        launch_draw = engine.stepper.launch_draw  # entered once a step that draws has launched its forward

        def recording_launch(seqs, logits, launch_draw=launch_draw):
            if seqs:  # decode rows, or chunks that end a prompt (mixed step)
                events.append("launch")
            return launch_draw(seqs, logits)

        engine.stepper.launch_draw = recording_launch
        run(engine, requests)
        streak = "".join("L" if e == "launch" else "R" for e in events)
        if overlap:
            assert "LLRLR" in streak and streak.count("R") == streak.count("L")
        else:
            assert "R" not in streak and "L" in streak, streak  # each step read at once, nothing in flight


def test_repetition_penalty_steps_see_the_token_in_flight(model, prompts):
    params = SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.3, temperature=0.8, seed=2)
    requests = requests_for(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    requests[1] = replace(requests[1], sampling=params)
    plain = run(make_engine(model, overlap_decode=False), requests)
    assert tokens_of(run(make_engine(model), requests)) == tokens_of(plain)


def test_a_closed_generator_leaves_nothing_in_flight(model, prompts):
    engine = make_engine(model)
    stream = engine.generate(requests_for(prompts, SamplingParams(max_tokens=12, ignore_eos=True)))
    next(stream)
    stream.close()
    assert engine.overlap.step is None and not engine.scheduler.running
    engine.cache.audit()
    again = run(engine, requests_for(prompts[:2], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(again) == 2


def test_decode_rows_share_prefix_kv_as_promised(model):
    """`shared_with_prev` (what lets attention read a shared prefix's KV once) never claims a
    slot two neighbouring rows do not share, and finds the planned shared prefixes."""
    prompts = shared_prefix_prompts(seed=8, groups=2, per_group=4, prefix_len=70)
    engine = make_engine(model)
    seen, decode = [], engine.runner.decode

    def checking_decode(rows):
        lengths = [p + 1 for p in rows.positions]
        contexts = rows.kv_indices.split(lengths)
        assert rows.shared_with_prev[0] == 0
        for r in range(1, len(contexts)):
            shared = rows.shared_with_prev[r]
            assert shared <= min(lengths[r - 1], lengths[r])
            assert contexts[r][:shared].equal(contexts[r - 1][:shared]), r
            seen.append(shared)
        return decode(rows)

    engine.runner.decode = checking_decode
    run(engine, requests_for(prompts, SamplingParams(max_tokens=5, ignore_eos=True)))
    assert max(seen) >= 70 and min(seen) == 0


def _checking_ring_mirrors(engine):
    """Wrap the decode launch: before each step, every row's host cursor (`SeqHandle.ring_cursor`)
    equals its slot's device cursor; returns the list of rows checked."""
    checked, decode = [], engine.runner.decode

    def checking_decode(rows):
        by_slot = {h.working_slot: h for h in engine.cache.running}
        device = engine.cache.state_pool.cursor
        for slot in rows.state_slots:
            assert by_slot[slot].ring_cursor == int(device[slot]), slot
            checked.append(by_slot[slot].ring_cursor)
        return decode(rows)

    engine.runner.decode = checking_decode
    return checked


@pytest.mark.parametrize("state_cache", ["extra_buffer", "no_buffer"])
def test_host_ring_cursors_mirror_the_device(model, prompts, state_cache):
    """The folds counted on the host (`replayssm_flushes`) are the device's: each running
    sequence's host cursor follows its working slot's through admission and every step."""
    engine = make_engine(model, state_cache=state_cache, ring_len=3, max_running=4)
    checked = _checking_ring_mirrors(engine)
    run(engine, requests_for(prompts, SamplingParams(max_tokens=9, ignore_eos=True)))
    assert set(checked) == {0, 1, 2, 3} and engine.stats.replayssm_flushes > 0


def test_host_ring_cursors_mirror_the_device_through_preemption():
    """A preempted sequence is re-admitted on a fresh working slot: both cursors start at 0."""
    config = model_config_from_dict({**PRESETS["tiny"], "full_attention_interval": 2})
    model = random_model(config, torch.float32, "cpu", seed=3)
    engine = make_engine(model, memory_budget_bytes=540_000, max_running=64, ring_len=3)
    checked = _checking_ring_mirrors(engine)
    run(engine, requests_for(shared_prefix_prompts(seed=5), SamplingParams(max_tokens=40, ignore_eos=True)))
    assert engine.stats.preemptions > 0 and set(checked) == {0, 1, 2, 3}
