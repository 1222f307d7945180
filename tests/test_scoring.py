"""Scoring requests: the summed logprob of given continuations equals transformers', with the
prompt shared by all continuations of a row through the prefix plan."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from batchinfer.engine.config import EngineConfig  # noqa: E402
from batchinfer.engine.engine import Engine  # noqa: E402
from batchinfer.engine.types import Request, SamplingParams  # noqa: E402
from tests.model_utils import hf_greedy, hf_logits, hf_reference, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("scoring"), "qwen3_5", seed=4)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_reference(checkpoint)


@pytest.fixture(scope="module")
def cases(reference):
    """(prompt, continuations) rows: long prompts (several prefill chunks), continuations that
    are prefixes of one another or repeat, and the greedy continuation."""
    rng = random.Random(2)
    rows = []
    for length in (70, 9, 62):  # 62: a tracked state (every 32) falls inside the continuations
        prompt = [rng.randrange(1, 256) for _ in range(length)]
        a = [rng.randrange(1, 256) for _ in range(4)]
        rows.append((prompt, [a, a[:2], [rng.randrange(1, 256)], hf_greedy(reference, prompt, 5), a]))
    return rows


def _requests(cases):
    requests = []
    for row, (prompt, continuations) in enumerate(cases):
        for j, continuation in enumerate(continuations):
            requests.append(Request((row, j), tuple(prompt + continuation), SamplingParams(max_tokens=1),
                                    seed_key=row, score_tokens=len(continuation)))
    return requests


def _scores(checkpoint, cases, **config):
    settings = dict(device="cpu", dtype="fp32", memory_budget_bytes=8 << 20, ring_len=4, track_interval=32)
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(**{**settings, **config}))
    outputs = {o.request_id: o for o in engine.generate(_requests(cases))}
    return engine, outputs


def _expected(reference, prompt, continuation):
    logp = hf_logits(reference, prompt + continuation).log_softmax(dim=-1)
    rows = logp[len(prompt) - 1:len(prompt) + len(continuation) - 1]
    picked = rows.gather(1, torch.tensor(continuation)[:, None])[:, 0]
    return picked.double().sum().item(), bool((rows.argmax(dim=1) == torch.tensor(continuation)).all())


@pytest.mark.parametrize("config", [{}, {"prefix_cache": False}, {"state_cache": "no_buffer"},
                                    {"max_batch_tokens": 48}, {"max_running": 1, "state_cache": "no_buffer"},
                                    {"max_running": 1}])
def test_scores_equal_transformers_summed_continuation_logprobs(checkpoint, reference, cases, config):
    engine, outputs = _scores(checkpoint, cases, **config)
    assert len(outputs) == sum(len(c) for _, c in cases)
    for row, (prompt, continuations) in enumerate(cases):
        for j, continuation in enumerate(continuations):
            out = outputs[(row, j)]
            assert out.finish_reason == "stop" and out.token_ids == () and out.completion_tokens == 0
            logprob, greedy = _expected(reference, prompt, continuation)
            assert abs(out.score.logprob - logprob) < 1e-4, (row, j)
            assert out.score.tokens == len(continuation) and out.score.greedy == greedy, (row, j)
        assert outputs[(row, 3)].score.greedy  # transformers' own greedy continuation
    if "prefix_cache" not in config and "state_cache" not in config:  # no_buffer tracks no branch states
        # k continuations cost one prompt plus k suffixes: all but the first reuse the prompt
        # up to its last token, which each computes again (its logits score the first token).
        for row, (prompt, continuations) in enumerate(cases):
            cached = [outputs[(row, j)].cached_tokens for j in range(len(continuations))]
            assert sorted(cached)[1:] == [len(prompt) - 1] * (len(continuations) - 1), (row, cached)


def test_scores_with_and_without_prefix_reuse_are_the_same(checkpoint, cases):
    _, shared = _scores(checkpoint, cases)
    _, alone = _scores(checkpoint, cases, prefix_cache=False)
    assert shared.keys() == alone.keys()
    for key, out in shared.items():
        assert abs(out.score.logprob - alone[key].score.logprob) < 1e-4, key
        assert (out.score.tokens, out.score.greedy) == (alone[key].score.tokens, alone[key].score.greedy), key


def test_scoring_and_generation_share_a_batch(checkpoint, reference, cases):
    prompt = cases[0][0]
    requests = _requests(cases[:1]) + [Request("gen", tuple(prompt), SamplingParams(max_tokens=4, ignore_eos=True))]
    settings = dict(device="cpu", dtype="fp32", memory_budget_bytes=8 << 20, ring_len=4, track_interval=32)
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(**settings))
    outputs = {o.request_id: o for o in engine.generate(requests)}
    assert list(outputs["gen"].token_ids) == hf_greedy(reference, prompt, 4)
    for j, continuation in enumerate(cases[0][1]):
        assert abs(outputs[(0, j)].score.logprob - _expected(reference, prompt, continuation)[0]) < 1e-4


def test_a_continuation_without_a_prompt_is_an_error_row(checkpoint):
    settings = dict(device="cpu", dtype="fp32", memory_budget_bytes=8 << 20, ring_len=4, track_interval=32)
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(**settings))
    out = next(iter(engine.generate([Request(0, (5, 6), SamplingParams(), score_tokens=2)])))
    assert out.finish_reason == "error" and "needs a prompt before it" in out.error
