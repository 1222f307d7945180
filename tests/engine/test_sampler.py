"""Sampler: filters against Hugging Face's processors, hash arithmetic, seeded reproducibility,
and that Gumbel-max draws from the right distribution."""
from __future__ import annotations

import random

import pytest
import torch

from batchinfer.engine.sampler import (SampleRow, SamplingTensors, _gumbel_argmax, _mix32, _mix32_int, _mul32, sample,
                                      uniform_noise, unit_interval)
from batchinfer.engine.types import SamplingParams

transformers_generation = pytest.importorskip("transformers.generation.logits_process")

CPU = torch.device("cpu")


def build(rows):
    return SamplingTensors.build(rows, CPU)


def lowbias32(x: int) -> int:
    """The finaliser `_mix32` implements, in exact integer arithmetic."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % (1 << 32)
    x ^= x >> 15
    x = (x * 0x846CA68B) % (1 << 32)
    return x ^ (x >> 16)


def test_mul32_and_mix32_match_exact_integer_arithmetic():
    rng = random.Random(0)
    values = [0, 1, 0xFFFFFFFF, 0x80000000] + [rng.randrange(1 << 32) for _ in range(500)]
    for constant in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF):
        got = _mul32(torch.tensor(values, dtype=torch.int64), constant).tolist()
        assert got == [(v * constant) % (1 << 32) for v in values]
    # The tensor path (per step) and the int path (per sequence) must give the same keys.
    assert _mix32(torch.tensor(values, dtype=torch.int64)).tolist() == [lowbias32(v) for v in values]
    assert [_mix32_int(v) for v in values] == [lowbias32(v) for v in values]


def test_uniform_noise_is_inside_the_unit_interval_and_flat():
    keys = torch.tensor([[1, 2], [3, 4], [0xFFFFFFFF, 0]], dtype=torch.int64)
    u = uniform_noise(keys, 50_000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    histogram = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert float((histogram - 0.1).abs().max()) < 0.01
    assert not torch.equal(u[0], u[1])


def test_the_top_hash_value_stays_below_one():
    """(2^24 - 1 + 0.5) / 2^24 rounds to 1.0 in fp32: its Gumbel noise would be +inf, and a
    masked (-inf) logit plus +inf is NaN, which argmax picks — at a 248k vocabulary about one
    sampled token in 70 would be a uniformly random one, grammar masks ignored."""
    u = unit_interval(torch.tensor([0, 1, 2**24 - 2, 2**24 - 1]))
    assert float(u.min()) > 0 and float(u.max()) < 1
    noise = -torch.log(-torch.log(u))
    assert torch.isfinite(noise).all()
    assert torch.equal(u[:3], (torch.tensor([0.0, 1.0, 2**24 - 2.0]) + 0.5) / 2**24)  # the rest unchanged


def test_a_masked_token_is_never_drawn_even_at_the_noise_maximum(monkeypatch):
    import batchinfer.engine.sampler as S

    vocab = 1000
    logits = torch.full((2, vocab), float("-inf"))
    logits[:, 7] = 0.0  # the grammar allows one token
    top = torch.full((2, vocab), 2**24 - 2, dtype=torch.int64)
    top[:, 500] = 2**24 - 1  # the hash's top value on a masked token
    monkeypatch.setattr(S, "uniform_noise", lambda keys, v: unit_interval(top[:len(keys), :v]))
    assert _gumbel_argmax(logits, torch.zeros(2, 2, dtype=torch.int64)).tolist() == [7, 7]


def test_greedy_is_argmax_and_respects_banned_tokens():
    logits = torch.randn(5, 33)
    rows = [SampleRow(SamplingParams(), seed_key=i, sample_index=0, position=0) for i in range(5)]
    assert torch.equal(sample(logits, build(rows)), logits.argmax(1))
    top = logits.argmax(1)
    rows[2] = SampleRow(SamplingParams(), 2, 0, 0, banned_token_ids=(int(top[2]),))
    got = sample(logits, build(rows))
    assert int(got[2]) == int(logits[2].topk(2).indices[1]) and torch.equal(got[[0, 1, 3, 4]], top[[0, 1, 3, 4]])


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(3, 40)
    seen = [(1, 2, 2, 7), (5,), (0, 39, 12, 13, 14)]
    penalties = [1.3, 0.7, 2.0]
    rows = [SampleRow(SamplingParams(repetition_penalty=p), 0, 0, 0, seen_token_ids=s)
            for p, s in zip(penalties, seen)]
    # Greedy under the penalty must pick the argmax of HF's penalised logits, row by row.
    got = sample(logits, build(rows))
    for i, (p, s) in enumerate(zip(penalties, seen)):
        processor = transformers_generation.RepetitionPenaltyLogitsProcessor(penalty=p)
        expected = processor(torch.tensor([list(s)]), logits[i:i + 1].clone())
        assert int(got[i]) == int(expected.argmax())


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (7, 0.9, 0.05)])
def test_filters_keep_the_same_tokens_as_transformers(top_k, top_p, min_p):
    from batchinfer.engine import sampler as module

    torch.manual_seed(1)
    scaled = torch.randn(6, 64) * 3
    ours = scaled.clone()
    if top_k or top_p < 1:
        ours = module._filter_top_k_top_p(ours, torch.full((6,), top_k), torch.full((6,), top_p))
    if min_p:
        ours = module._filter_min_p(ours, torch.full((6,), min_p))
    theirs = scaled.clone()
    ids = torch.zeros(6, 1, dtype=torch.int64)
    if top_k:
        theirs = transformers_generation.TopKLogitsWarper(top_k)(ids, theirs)
    if top_p < 1:
        theirs = transformers_generation.TopPLogitsWarper(top_p)(ids, theirs)
    if min_p:
        theirs = transformers_generation.MinPLogitsWarper(min_p)(ids, theirs)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert torch.isfinite(ours).sum(1).min() >= 1


def test_seeded_tokens_do_not_depend_on_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(8, 97)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1234)
    rows = [SampleRow(params, seed_key=i % 3, sample_index=i // 3, position=i) for i in range(8)]
    full = sample(logits, build(rows))
    # Any subset, in any order, mixed with greedy strangers, draws the same tokens.
    order = [6, 1, 4]
    stranger = SampleRow(SamplingParams(), seed_key=99, sample_index=0, position=0)
    mixed_logits = torch.cat([logits[order], torch.randn(1, 97)])
    mixed = sample(mixed_logits, build([rows[i] for i in order] + [stranger]))
    assert mixed[:3].tolist() == full[order].tolist()
    assert sample(logits, build(rows)).tolist() == full.tolist()  # rerun


def test_each_identity_field_changes_the_noise():
    logits = torch.zeros(1, 1000)  # flat: the pick is decided by the noise alone
    base = dict(params=SamplingParams(temperature=1.0, seed=5), seed_key=7, sample_index=1, position=3)
    pick = int(sample(logits, build([SampleRow(**base)]))[0])
    for change in (dict(params=SamplingParams(temperature=1.0, seed=6)), dict(seed_key=8),
                   dict(sample_index=2), dict(position=4), dict(seed_key=7 + (1 << 40))):
        assert int(sample(logits, build([SampleRow(**{**base, **change})]))[0]) != pick, change


def test_gumbel_max_draws_from_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 3.0]])
    temperature, draws = 0.7, 6000
    params = SamplingParams(temperature=temperature, seed=11)
    rows = [SampleRow(params, seed_key=0, sample_index=0, position=i) for i in range(draws)]
    tokens = sample(logits.expand(draws, -1), build(rows))
    frequency = torch.bincount(tokens, minlength=6).float() / draws
    expected = (logits[0] / temperature).softmax(0)
    assert float((frequency - expected).abs().max()) < 0.02  # ~4 standard errors at this size


def test_token_bitmask_masks_exactly_the_disallowed_tokens():
    from batchinfer.engine.sampler import apply_token_bitmask

    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partial
    allowed = torch.rand(3, vocab, generator=gen) < 0.3
    words = torch.zeros(3, 3, dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    bitmask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # int32 bit patterns
    for rows in (None, torch.tensor([0, 2, 3])):
        logits = torch.randn(3 if rows is None else 4, vocab, generator=gen)
        before = logits.clone()
        apply_token_bitmask(logits, rows, bitmask)
        targets = [0, 1, 2] if rows is None else [0, 2, 3]
        for mask_row, row in enumerate(targets):
            assert torch.equal(torch.isinf(logits[row]), ~allowed[mask_row])
            assert torch.equal(logits[row][allowed[mask_row]], before[row][allowed[mask_row]])
        if rows is not None:
            assert torch.equal(logits[1], before[1])
