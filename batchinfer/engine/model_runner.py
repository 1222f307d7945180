"""Turns scheduled sequence chunks into a `ForwardBatch`, runs the model, returns logits.

The runner knows nothing about requests or the cache's bookkeeping: it is handed, per
sequence, the new tokens, where they start, the GDN working slot and the KV slots of the
whole context (new tokens included, already allocated). It owns no state besides optional
CUDA graphs for decode steps (cuda_graphs.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from batchinfer.engine.cuda_graphs import DecodeGraphs, select_tokens
from batchinfer.engine.host_copy import upload_packed
from batchinfer.models.forward_batch import ForwardBatch, ModelCaches
from batchinfer.kernels.public import ChunkTables


@dataclass(frozen=True)
class SequenceChunk:
    token_ids: Sequence[int]      # new tokens of this step
    start: int                    # absolute position of the first new token
    state_slot: int               # GDN working slot (holds the state at `start`)
    context_kv: torch.Tensor      # [start + len(token_ids)] int64 CPU: KV slots of the whole context
    wants_logits: bool            # the chunk ends where a token is to be sampled
    score_logits: int = 0         # instead: logits at the chunk's last `score_logits` positions (scoring)

    @property
    def num_logits(self) -> int:
        return self.score_logits or int(self.wants_logits)


@dataclass(frozen=True)
class DecodeRows:
    """One decode step, one entry per sequence, as plain lists (no per-sequence objects).

    A token the host does not know yet (drawn by the previous decode step, still in flight)
    comes from the device: row i feeds `prior_tokens[token_from[i]]` where `token_from[i] >= 0`."""
    token_ids: list[int]              # [B] the token each sequence feeds (any value where taken from the device)
    positions: list[int]              # [B] its absolute position
    state_slots: list[int]            # [B] GDN working slots
    kv_indices: torch.Tensor          # [Σ(positions + 1)] int64 CPU: each whole context in turn, new token last
    token_from: Optional[list[int]] = None     # [B] row of prior_tokens, or -1: token_ids[i]
    prior_tokens: Optional[torch.Tensor] = None  # [B'] int64 on the device: the previous step's draws
    shared_with_prev: Optional[list[int]] = None  # [B] ForwardBatch.shared_with_prev (attention reads shared KV once)


def _forward_batch(input_ids, positions, cu_seqlens, state_slots, out_kv, kv_indices, kv_indptr, logits_indices,
                   *, is_decode: bool, replay: bool, device: torch.device, token_from=None,
                   prior_tokens: Optional[torch.Tensor] = None, shared_with_prev=None) -> ForwardBatch:
    optional = {name: t for name, t in (("token_from", token_from), ("shared", shared_with_prev)) if t is not None}
    parts = [input_ids, positions, cu_seqlens, state_slots, out_kv, kv_indices, kv_indptr, logits_indices,
             *optional.values()]  # all in one transfer
    (input_ids, positions, cu_seqlens, state_slots, out_kv, kv_indices, kv_indptr, logits_indices,
     *rest) = upload_packed(parts, device)
    extra = dict(zip(optional, rest))
    if prior_tokens is not None:
        input_ids = select_tokens(input_ids, extra["token_from"], prior_tokens)
    cu_seqlens = cu_seqlens.to(torch.int32)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, cu_seqlens=cu_seqlens, is_decode=is_decode,
        state_slots=state_slots, out_kv_slots=out_kv, kv_indices=kv_indices,
        kv_indptr=kv_indptr.to(torch.int32), logits_indices=logits_indices, replay=replay and is_decode,
        shared_with_prev=extra["shared"].to(torch.int32) if "shared" in extra else None,
        chunk_tables=None if is_decode else ChunkTables(cu_seqlens, input_ids.shape[0]))


def _prefill_host(chunks: Sequence[SequenceChunk]) -> dict[str, torch.Tensor]:
    """A prefill batch's index tensors on the host (int64), chunks in order."""
    lengths = [len(c.token_ids) for c in chunks]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return dict(
        input_ids=torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64),           # [T]
        positions=torch.cat([torch.arange(c.start, c.start + n, dtype=torch.int64)
                             for c, n in zip(chunks, lengths)]),                                     # [T]
        out_kv=torch.cat([c.context_kv[c.start:] for c in chunks]),                                 # [T]
        state_slots=torch.tensor([c.state_slot for c in chunks], dtype=torch.int64),                 # [B]
        kv_indices=torch.cat([c.context_kv for c in chunks]),                                       # [Σctx]
        kv_indptr=torch.tensor([0] + [c.context_kv.numel() for c in chunks], dtype=torch.int64).cumsum(0),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64),                                              # [B+1]
        logits_indices=torch.tensor([end - k for c, end in zip(chunks, cu[1:]) for k in range(c.num_logits, 0, -1)],
                                    dtype=torch.int64))                                              # [N]


def _decode_host(rows: DecodeRows) -> dict[str, torch.Tensor]:
    """A decode step's index tensors on the host (int64): a few tensor builds whatever B."""
    B = len(rows.token_ids)
    kv_indices = rows.kv_indices                                                                # [Σctx]
    if sum(rows.positions) + B != kv_indices.numel():
        raise ValueError("each decode context must hold its position + 1 KV slots")
    host = torch.tensor([rows.token_ids, rows.positions, rows.state_slots], dtype=torch.int64)  # [3, B]
    kv_indptr = torch.zeros(B + 1, dtype=torch.int64)
    torch.cumsum(host[1] + 1, 0, out=kv_indptr[1:])                                             # [B+1]
    steps = torch.arange(B + 1, dtype=torch.int64)           # one token per sequence
    return dict(input_ids=host[0], positions=host[1], out_kv=kv_indices[kv_indptr[1:] - 1],  # the new token ends its context
                state_slots=host[2], kv_indices=kv_indices, kv_indptr=kv_indptr, cu_seqlens=steps,
                logits_indices=steps[:B])


def build_forward_batch(chunks: Sequence[SequenceChunk], *, is_decode: bool, replay: bool,
                        device: torch.device) -> ForwardBatch:
    """Pack chunks (in order) into one varlen batch; logits only for chunks that want them."""
    h = _prefill_host(chunks)
    return _forward_batch(h["input_ids"], h["positions"], h["cu_seqlens"], h["state_slots"], h["out_kv"],
                          h["kv_indices"], h["kv_indptr"], h["logits_indices"], is_decode=is_decode, replay=replay,
                          device=device)


def build_decode_batch(rows: DecodeRows, *, replay: bool, device: torch.device) -> ForwardBatch:
    """A decode step's batch from flat lists: a few tensor builds whatever the batch size."""
    h = _decode_host(rows)
    token_from = None if rows.prior_tokens is None else torch.tensor(rows.token_from, dtype=torch.int64)  # [B]
    shared = None if rows.shared_with_prev is None else torch.tensor(rows.shared_with_prev, dtype=torch.int64)  # [B]
    return _forward_batch(h["input_ids"], h["positions"], h["cu_seqlens"], h["state_slots"], h["out_kv"],
                          h["kv_indices"], h["kv_indptr"], h["logits_indices"], is_decode=True, replay=replay,
                          device=device, token_from=token_from, prior_tokens=rows.prior_tokens,
                          shared_with_prev=shared)


def build_mixed_batch(chunks: Sequence[SequenceChunk], rows: DecodeRows, *, replay: bool,
                      device: torch.device) -> ForwardBatch:
    """One batch of prefill chunks followed by decode rows (`ForwardBatch.parts`): the chunks'
    logits rows (as `build_forward_batch`), then one per decode row. All index tensors go in one
    transfer; each part's tensors are views of the whole batch's, or of its own where they differ
    (the decode part's context offsets and token steps start at 0)."""
    p, d = _prefill_host(chunks), _decode_host(rows)
    T_p, B_p, B_d, ctx_p = p["input_ids"].numel(), len(chunks), len(rows.token_ids), p["kv_indices"].numel()
    # The whole batch's tensors, prefill part first: the parts are views of them.
    whole = [torch.cat([p[name], d[name]]) for name in ("input_ids", "positions", "out_kv", "state_slots", "kv_indices")]
    cu = torch.cat([p["cu_seqlens"], T_p + d["cu_seqlens"][1:]])                              # [B+1]
    indptr = torch.cat([p["kv_indptr"], ctx_p + d["kv_indptr"][1:]])                          # [B+1]
    logits = torch.cat([p["logits_indices"], T_p + d["logits_indices"]])                      # [N_p + B_d]
    token_from = None if rows.prior_tokens is None else rows.token_from
    optional = {name: v for name, v in (("token_from", token_from), ("shared", rows.shared_with_prev)) if v is not None}
    (ids, pos, out_kv, slots, kv, cu, indptr, d_steps, d_indptr, logits, *rest) = upload_packed(
        [*whole, cu, indptr, d["cu_seqlens"], d["kv_indptr"], logits,
         *(torch.tensor(v, dtype=torch.int64) for v in optional.values())], device)
    extra = dict(zip(optional, rest))
    if token_from is not None:  # decode rows whose token is still on the device: written into the whole batch's ids
        select_tokens(ids[T_p:], extra["token_from"], rows.prior_tokens, out=ids[T_p:])
    cu, indptr, d_cu, d_indptr = (t.to(torch.int32) for t in (cu, indptr, d_steps, d_indptr))
    N_p, p_cu = p["logits_indices"].numel(), cu[:B_p + 1]  # one view: the chunk tables are matched by identity
    prefill = ForwardBatch(
        input_ids=ids[:T_p], positions=pos[:T_p], cu_seqlens=p_cu, is_decode=False, state_slots=slots[:B_p],
        out_kv_slots=out_kv[:T_p], kv_indices=kv[:ctx_p], kv_indptr=indptr[:B_p + 1], logits_indices=logits[:N_p],
        chunk_tables=ChunkTables(p_cu, T_p))
    decode = ForwardBatch(
        input_ids=ids[T_p:], positions=pos[T_p:], cu_seqlens=d_cu, is_decode=True, state_slots=slots[B_p:],
        out_kv_slots=out_kv[T_p:], kv_indices=kv[ctx_p:], kv_indptr=d_indptr, logits_indices=d_steps[:B_d],
        replay=replay, shared_with_prev=extra["shared"].to(torch.int32) if "shared" in extra else None)
    return ForwardBatch(input_ids=ids, positions=pos, cu_seqlens=cu, is_decode=False, state_slots=slots,
                        out_kv_slots=out_kv, kv_indices=kv, kv_indptr=indptr, logits_indices=logits,
                        parts=(prefill, decode))


class ModelRunner:
    """Runs prefill and decode steps of `model` over `caches` (the pools' tensors)."""

    def __init__(self, model, caches: ModelCaches, device: torch.device, *, replay: bool,
                 decode_graphs: Optional[DecodeGraphs] = None) -> None:
        self.model = model
        self.caches = caches
        self.device = device
        self.replay = replay
        self.decode_graphs = decode_graphs  # optional: replays captured decode steps (CUDA)

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Logits [N, V] fp32: `num_logits` rows per chunk (in chunk order, positions ascending)."""
        batch = build_forward_batch(chunks, is_decode=False, replay=False, device=self.device)
        return self.model.forward(batch, self.caches)

    @torch.inference_mode()
    def mixed(self, chunks: Sequence[SequenceChunk], rows: DecodeRows) -> torch.Tensor:
        """Prefill chunks and decode rows in one forward (eager: no graph): logits [N, V] fp32,
        the chunks' rows as `prefill`, then one per decode row. ReplaySSM as in `decode`."""
        batch = build_mixed_batch(chunks, rows, replay=self.replay, device=self.device)
        return self.model.forward(batch, self.caches)

    @torch.inference_mode()
    def decode(self, rows: DecodeRows) -> torch.Tensor:
        """One token per sequence, each wants logits: [B, V] fp32.

        Under ReplaySSM the model advances each slot's ring cursor (docs/MODULES.md)."""
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run(rows.token_ids, rows.positions, rows.state_slots, rows.kv_indices,
                                            token_from=rows.token_from, prior_tokens=rows.prior_tokens,
                                            shared_with_prev=rows.shared_with_prev)
            if logits is not None:
                return logits  # a view of the graph's output: consume before the next step
        return self.model.forward(build_decode_batch(rows, replay=self.replay, device=self.device), self.caches)
