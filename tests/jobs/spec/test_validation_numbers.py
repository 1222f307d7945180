"""Engine API: SamplingParams rejects what the job-file checks reject (NaN, inf, wide seeds, min > max)."""
from __future__ import annotations

import math

import pytest

from batchinfer.engine.sampler import identity_key
from batchinfer.engine.types import SamplingParams


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_sampling_params_reject_non_finite_floats(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("seed", [-1, 2**64, 2**64 + 5])
def test_sampling_params_reject_seeds_outside_64_bits(seed):
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        SamplingParams(seed=seed)


def test_seeds_at_both_ends_of_the_range_are_accepted_and_distinct_streams():
    # The sampler hashes the seed's two 32-bit words: within [0, 2**64) no two seeds share a stream.
    keys = {identity_key(SamplingParams(seed=seed), 0, 0) for seed in (0, 5, 2**32 + 5, 2**64 - 1)}
    assert len(keys) == 4


def test_sampling_params_reject_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3
