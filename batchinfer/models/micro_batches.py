"""Cutting a pipelined step into micro-batches, and the order stages run them in.

`split_decode` cuts a decode batch's rows without reading anything on the host: every
micro-batch keeps the whole `kv_indices` and its absolute `kv_indptr` slice (every attention
kernel reads a context from `kv_indptr[i]`, not from 0), so a cut is views whose shapes depend
on the row count only and can be captured in a CUDA graph (`decode_micro_batch`: one of them).
`split_prefill` cuts a prefill batch by sequences, balanced by tokens. `wavefront` is the
(stage, micro-batch) order: micro-batch m reaches stage s at tick s + m.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Iterator, Sequence

import torch

from batchinfer.kernels.public import ChunkTables
from batchinfer.models.forward_batch import ForwardBatch


def wavefront(num_micro: int, num_stages: int) -> Iterator[tuple[int, int]]:
    """(stage, micro-batch) pairs in wavefront order."""
    for tick in range(num_micro + num_stages - 1):
        for s in range(num_stages):
            if 0 <= tick - s < num_micro:
                yield s, tick - s


def batch_on(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The batch's tensors on `device` (itself when they are there already)."""
    if batch.input_ids.device == device:
        return batch
    moved = {f.name: getattr(batch, f.name).to(device, non_blocking=True) for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    if batch.parts is not None:
        moved["parts"] = tuple(batch_on(p, device) for p in batch.parts)
    if batch.chunk_tables is not None:
        moved["chunk_tables"] = ChunkTables(moved["cu_seqlens"], batch.num_tokens)
    return replace(batch, **moved)


def split_decode(batch: ForwardBatch, parts: int) -> list[ForwardBatch]:
    """A decode batch's rows in `parts` contiguous micro-batches (fewer when it has fewer rows).
    No host read: each micro-batch keeps the whole `kv_indices` and its absolute `kv_indptr`
    slice (every attention kernel reads a context at `kv_indptr[i]`, not from 0), so the cut is
    a set of views whose shapes depend on the row count only (CUDA-graph capturable)."""
    parts = min(parts, batch.num_seqs)
    if parts <= 1 or not batch.is_decode or batch.parts is not None:
        return [batch]
    return [decode_micro_batch(batch, parts, m) for m in range(parts)]


def decode_micro_batch(batch: ForwardBatch, parts: int, m: int) -> ForwardBatch:
    """Micro-batch m of `split_decode(batch, parts)` (parts <= rows), alone: a stage graph
    captures its own cut, so the shared-prefix hint is re-read from the batch at each replay."""
    B = batch.num_seqs
    a, b = B * m // parts, B * (m + 1) // parts
    shared = None
    if batch.shared_with_prev is not None:
        shared = batch.shared_with_prev[a:b].clone()
        shared[:1].zero_()  # its first row has no row before it here; a device fill (`[0] = 0` copies a host scalar: no graph capture)
    steps = batch.cu_seqlens[: b - a + 1]  # 0..n: one token per row
    return replace(
        batch, input_ids=batch.input_ids[a:b], positions=batch.positions[a:b], cu_seqlens=steps,
        state_slots=batch.state_slots[a:b], out_kv_slots=batch.out_kv_slots[a:b],
        kv_indptr=batch.kv_indptr[a:b + 1], logits_indices=batch.logits_indices[: b - a], shared_with_prev=shared)


def prefill_edges(cu: Sequence[int], parts: int) -> list[int]:
    """Sequence edges `[0, …, B]` of at most `parts` contiguous groups, each cut at the sequence
    boundary nearest an even share of the tokens (`cu`: the token offsets, [B+1]); a sequence is
    never cut, so one long sequence stays whole."""
    B, total = len(cu) - 1, cu[-1]
    edges = [0]
    for k in range(1, min(parts, B)):
        candidates = range(edges[-1] + 1, B)
        if not candidates:
            break
        edges.append(min(candidates, key=lambda i: abs(cu[i] - total * k / parts)))
    return edges + [B]


def split_prefill(batch: ForwardBatch, parts: int) -> list[ForwardBatch]:
    """A prefill batch's sequences in at most `parts` contiguous micro-batches balanced by tokens
    (`prefill_edges`). One host read of the token offsets and logits rows (a prefill step reads
    them anyway for its attention); the context stays whole with absolute offsets, as in
    `split_decode`. Mixed and single-sequence batches stay one micro-batch."""
    B = batch.num_seqs
    if parts <= 1 or B <= 1 or batch.is_decode or batch.parts is not None:
        return [batch]
    host = torch.cat([batch.cu_seqlens.to(torch.int64), batch.logits_indices]).tolist()
    cu, rows = host[:B + 1], host[B + 1:]
    edges = prefill_edges(cu, parts)
    if len(edges) <= 2:
        return [batch]
    out, r0 = [], 0
    for a, b in zip(edges[:-1], edges[1:]):
        t0, t1 = cu[a], cu[b]
        r1 = r0
        while r1 < len(rows) and rows[r1] < t1:  # logits rows ascend with the tokens
            r1 += 1
        steps = batch.cu_seqlens[a:b + 1] - t0
        out.append(replace(
            batch, input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1], cu_seqlens=steps,
            state_slots=batch.state_slots[a:b], out_kv_slots=batch.out_kv_slots[t0:t1],
            kv_indptr=batch.kv_indptr[a:b + 1], logits_indices=batch.logits_indices[r0:r1] - t0,
            chunk_tables=None if batch.chunk_tables is None else ChunkTables(steps, t1 - t0)))
        r0 = r1
    return out
