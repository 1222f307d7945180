"""Greedy output of the engine equals transformers' generate for the same checkpoint."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from batchinfer.engine.config import EngineConfig  # noqa: E402
from batchinfer.engine.engine import Engine  # noqa: E402
from batchinfer.engine.types import Request, SamplingParams  # noqa: E402
from tests.model_utils import hf_greedy, hf_reference, make_tiny_checkpoint  # noqa: E402

STEPS = 7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine_parity"), "qwen3_5", seed=5)


def test_greedy_matches_transformers_generate(checkpoint):
    rng = random.Random(0)
    base = [rng.randrange(1, 256) for _ in range(67)]  # crosses the 64-token chunk
    prompts = [base, base[:40] + [rng.randrange(1, 256) for _ in range(13)], base + [7, 9, 11],
               [rng.randrange(1, 256) for _ in range(5)]]
    config = EngineConfig(device="cpu", dtype="fp32", memory_budget_bytes=8 << 20, ring_len=4,
                          track_interval=32)
    engine = Engine.from_pretrained(str(checkpoint), config)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    outputs = {o.request_id: o for o in engine.generate(
        Request(i, tuple(p), params, seed_key=i) for i, p in enumerate(prompts))}
    assert engine.stats.cached_tokens > 0  # the shared prefixes really came from the cache
    reference = hf_reference(checkpoint)
    for i, prompt in enumerate(prompts):
        assert list(outputs[i].token_ids) == hf_greedy(reference, prompt, STEPS), f"prompt {i}"
