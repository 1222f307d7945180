"""Engine sampling and stopping: seeded samples independent of the batch, n samples, stop
tokens / strings / EOS / min_tokens / lengths, rejected requests, resumed samples."""
from __future__ import annotations

from dataclasses import replace

import pytest

from batchinfer.engine.types import Request, SamplingParams
from tests.engine_utils import make_engine, requests_for, run, shared_prefix_prompts, tiny_model, tokens_of

SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, top_k=60, top_p=0.95, seed=7, n=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=8, groups=2, per_group=3)


@pytest.fixture(scope="module")
def sampled_all(model, prompts):
    return tokens_of(run(make_engine(model), requests_for(prompts, SAMPLED)))


def test_seeded_samples_do_not_depend_on_the_batch_or_the_run(model, prompts, sampled_all):
    requests = requests_for(prompts, SAMPLED)
    # Alone, in reverse order with other batch sizes, and without any cache: the same tokens.
    alone = tokens_of(run(make_engine(model), [requests[2]]))
    assert alone == {k: v for k, v in sampled_all.items() if k[0] == 2}
    reordered = run(make_engine(model, max_running=2, prefix_cache=False, replayssm=False), requests[::-1])
    assert tokens_of(reordered) == sampled_all
    assert tokens_of(run(make_engine(model), requests)) == sampled_all


def test_n_samples_differ_and_skipped_samples_are_not_generated(model, prompts, sampled_all):
    for i in range(len(prompts)):
        assert len({sampled_all[(i, s)] for s in range(3)}) > 1  # 8 tokens at T=0.9: not all equal
    resumed = Request(request_id=1, prompt_token_ids=tuple(prompts[1]), sampling=SAMPLED, seed_key=1,
                      skip_samples=(0, 2))
    outputs = run(make_engine(model), [resumed])
    assert tokens_of(outputs) == {(1, 1): sampled_all[(1, 1)]}


def test_seed_and_seed_key_change_the_samples(model, prompts, sampled_all):
    requests = requests_for(prompts[:1], replace(SAMPLED, seed=8))
    assert tokens_of(run(make_engine(model), requests))[(0, 0)] != sampled_all[(0, 0)]
    other_key = [replace(requests_for(prompts[:1], SAMPLED)[0], seed_key=99)]
    assert tokens_of(run(make_engine(model), other_key))[(0, 0)] != sampled_all[(0, 0)]


@pytest.fixture(scope="module")
def greedy_tokens(model, prompts):
    request = requests_for(prompts[:1], SamplingParams(max_tokens=6, ignore_eos=True))
    return run(make_engine(model), request)[(0, 0)].token_ids


def _one(model, prompt, params, **engine_settings):
    eos = engine_settings.pop("eos_token_ids", ())
    detokenize = engine_settings.pop("detokenize", None)
    engine = make_engine(model, **engine_settings)
    engine.stop_rules = replace(engine.stop_rules, eos_token_ids=frozenset(eos), detokenize=detokenize)
    return run(engine, [Request(0, tuple(prompt), params, seed_key=0)])[(0, 0)]


def test_stop_token_ids_eos_and_ignore_eos(model, prompts, greedy_tokens):
    t = greedy_tokens
    assert len(set(t)) == len(t), "pick another seed: the test wants distinct greedy tokens"
    out = _one(model, prompts[0], SamplingParams(max_tokens=6, stop_token_ids=(t[2],)))
    assert out.token_ids == t[:3] and out.finish_reason == "stop"
    out = _one(model, prompts[0], SamplingParams(max_tokens=6), eos_token_ids=(t[3],))
    assert out.token_ids == t[:4] and out.finish_reason == "stop"
    out = _one(model, prompts[0], SamplingParams(max_tokens=6, ignore_eos=True), eos_token_ids=(t[3],))
    assert out.token_ids == t and out.finish_reason == "length"


def test_min_tokens_bans_stop_tokens_until_reached(model, prompts, greedy_tokens):
    t = greedy_tokens
    out = _one(model, prompts[0], SamplingParams(max_tokens=6, stop_token_ids=(t[0],), min_tokens=1))
    assert out.token_ids[0] != t[0] and out.completion_tokens >= 2


def test_stop_strings_through_the_detokenizer(model, prompts, greedy_tokens):
    t = greedy_tokens
    out = _one(model, prompts[0], SamplingParams(max_tokens=6, stop=(f"<{t[1]}><{t[2]}>",)),
               detokenize=lambda ids: "".join(f"<{i}>" for i in ids))
    assert out.token_ids == t[:3] and out.finish_reason == "stop"


def test_max_tokens_and_max_model_len(model, prompts, greedy_tokens):
    out = _one(model, prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out.token_ids == greedy_tokens[:2] and out.finish_reason == "length"
    out = _one(model, prompts[0], SamplingParams(max_tokens=6, ignore_eos=True),
               max_model_len=len(prompts[0]) + 3)
    assert out.token_ids == greedy_tokens[:3] and out.finish_reason == "length"


def test_bad_requests_fail_alone(model, prompts):
    params = SamplingParams(max_tokens=3, ignore_eos=True, n=2)
    requests = [Request("empty", (), params), Request("long", tuple(range(40)), params),
                Request("vocab", (1, 2, 10_000), params), Request("fine", tuple(prompts[0][:20]), params)]
    outputs = run(make_engine(model, max_model_len=40), requests)
    assert len(outputs) == 8
    for name in ("empty", "long", "vocab"):
        for s in range(2):
            out = outputs[(name, s)]
            assert out.finish_reason == "error" and out.error and out.token_ids == ()
    assert outputs[("fine", 0)].finish_reason == "length" and outputs[("fine", 1)].completion_tokens == 3


def test_an_abandoned_generate_leaves_the_engine_clean(model, prompts):
    engine = make_engine(model)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    stream = engine.generate(requests_for(prompts, params))
    next(stream)
    stream.close()
    assert not engine.cache.running and not engine.scheduler.has_work
    engine.cache.audit()
    again = run(engine, requests_for(prompts[:2], params))
    assert sorted(again) == [(0, 0), (1, 0)]
