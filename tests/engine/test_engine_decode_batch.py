"""The decode hot path's vectorised builders agree with the general ones they replace."""
from __future__ import annotations

import random

import torch

from batchinfer.engine.model_runner import DecodeRows, SequenceChunk, build_decode_batch, build_forward_batch
from batchinfer.engine.sampler import (SampleRow, SamplingTensors, _split64, finish_row_keys, identity_key,
                                       row_keys, sample)
from batchinfer.engine.types import SamplingParams

CPU = torch.device("cpu")


def test_decode_batch_equals_the_general_builder():
    rng = random.Random(0)
    slots = torch.randperm(1000)  # out-of-order KV slots
    chunks, used = [], 0
    for length in (1, 63, 64, 65, 7):  # context lengths around a chunk boundary
        context = slots[used:used + length]
        used += length
        chunks.append(SequenceChunk(token_ids=[rng.randrange(512)], start=length - 1,
                                    state_slot=rng.randrange(40), context_kv=context, wants_logits=True))
    rows = DecodeRows(token_ids=[c.token_ids[0] for c in chunks], positions=[c.start for c in chunks],
                      state_slots=[c.state_slot for c in chunks], kv_indices=torch.cat([c.context_kv for c in chunks]))
    fast = build_decode_batch(rows, replay=True, device=CPU)
    general = build_forward_batch(chunks, is_decode=True, replay=True, device=CPU)
    for name in ("input_ids", "positions", "cu_seqlens", "state_slots", "out_kv_slots", "kv_indices", "kv_indptr",
                 "logits_indices"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.is_decode and fast.replay


def test_prefill_batches_carry_one_set_of_chunk_tables_for_their_cu_seqlens():
    chunks = [SequenceChunk(token_ids=list(range(n)), start=0, state_slot=i, context_kv=torch.arange(n),
                            wants_logits=True) for i, n in enumerate((70, 3))]
    prefill = build_forward_batch(chunks, is_decode=False, replay=False, device=CPU)
    assert prefill.chunk_tables.cu_seqlens is prefill.cu_seqlens and prefill.chunk_tables.num_tokens == 73
    assert prefill.chunk_tables.get(64).seq_offsets.tolist() == [0, 2, 3]
    assert build_forward_batch(chunks, is_decode=True, replay=False, device=CPU).chunk_tables is None


def test_identity_keys_then_position_equal_the_full_row_keys():
    rng = random.Random(1)
    params = [SamplingParams(seed=rng.randrange(2**64)) for _ in range(9)]
    seed_keys = [rng.randrange(2**64) for _ in params]
    samples = [rng.randrange(2**33) for _ in params]
    positions = [rng.randrange(2**31) for _ in params]
    words = []
    for p, key, s, pos in zip(params, seed_keys, samples, positions):
        words.append((*_split64(p.seed), *_split64(key), s & 0xFFFFFFFF, pos))
    expected = row_keys(torch.tensor(words, dtype=torch.int64))
    identity = torch.tensor([identity_key(p, k, s) for p, k, s in zip(params, seed_keys, samples)])
    assert torch.equal(finish_row_keys(identity, torch.tensor(positions)), expected)


def test_mixed_greedy_and_sampled_rows_draw_as_when_alone():
    """Shared params objects, greedy rows between sampled ones, a banned token: each row's token
    is the one it draws in a batch of its own."""
    torch.manual_seed(2)
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=5)
    rows = [SampleRow(hot if i % 3 else greedy, seed_key=i, sample_index=i % 2, position=3 * i,
                      banned_token_ids=(7,) if i == 4 else ()) for i in range(7)]
    logits = torch.randn(len(rows), 300)
    logits[4, 7] = 50.0  # banned: must not be drawn
    together = sample(logits, SamplingTensors.build(rows, CPU))
    alone = torch.cat([sample(logits[i:i + 1], SamplingTensors.build([row], CPU)) for i, row in enumerate(rows)])
    assert torch.equal(together, alone) and int(together[4]) != 7
    assert torch.equal(together[0::3], logits[0::3].argmax(dim=1))
    assert logits[4, 7] == 50.0  # the caller's logits are not edited
