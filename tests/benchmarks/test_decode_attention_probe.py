"""The decode attention probe (`decode_profile --attention-probe`), on the CPU (interpreter, tiny
shapes, timing stubbed): every variant attends the same keys of an engine-shaped batch (a graph
view longer than the rows' contexts, padding slots after them), so each output matches the
engine call's."""
from __future__ import annotations

import types

import torch

from tests.conftest import interpreter_only


@interpreter_only
def test_every_probe_variant_attends_the_same_keys(monkeypatch):
    from benchmarks import decode_attention_probe

    monkeypatch.setattr(decode_attention_probe, "time_ms", lambda fn, device, **_: 1.0)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 9, 3])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    used, pad_slot = int(indptr[-1]), 40
    indices = torch.full((3 * 16,), pad_slot, dtype=torch.int64)  # the graph's view: ctx_cap 16 a row
    indices[:used] = torch.randperm(pad_slot, generator=gen)[:used]
    batch = types.SimpleNamespace(kv_indices=indices, kv_indptr=indptr,
                                  shared_with_prev=torch.zeros(3, dtype=torch.int32))
    k = torch.randn(pad_slot + 1, 2, 16, generator=gen).bfloat16()
    v = torch.randn(pad_slot + 1, 2, 16, generator=gen).bfloat16()
    rows = decode_attention_probe.probe(batch, k, v, heads=4)
    timed = [r for r in rows if r[1] == r[1]]
    assert len(timed) == 15 and "KV positions 17 (min 3, max 9)" in rows[-1][0]
    compared = [(name, diff) for name, _, _, diff in timed if diff == diff]
    assert len(compared) == 14  # all but the uniform-context timing
    for name, diff in compared:
        assert diff < 2e-2, name  # bf16 outputs; a variant over other keys differs by O(1)
