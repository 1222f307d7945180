"""Decode steps replayed from CUDA graphs at a ladder of batch sizes.

A decode step's shapes depend only on the batch size B, except the flat list of context KV
slots. So every input lives in a static buffer sized for the largest bucket; a step of B
sequences runs the graph of the smallest bucket b >= B, the b - B padding rows pointing at
the pools' scratch rows (`pad_slot`: never allocated, free to be overwritten). The context
list gets a fixed capacity of `ctx_cap` slots per row; a step whose contexts do not fit runs
eagerly instead (the runner falls back when `run` returns None).

How a bucket's forward is captured and replayed is a strategy (`forward`): `WholeModelGraphs`
(one graph of the whole model, the default) or a pipelined model's per-stage graphs
(engine/stage_graphs.py); both run over the same static buffers and padding.

Without CUDA (`capture=False`) the same static-buffer path runs the model directly, so the
padding and buffer logic is tested on the CPU.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from batchinfer.engine.host_copy import upload_packed
from batchinfer.models.forward_batch import ForwardBatch, ModelCaches

_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
log = logging.getLogger(__name__)


def select_tokens(host_ids: torch.Tensor, token_from: torch.Tensor, prior: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each row's input token: `prior[token_from[i]]` where `token_from[i] >= 0` (a token the
    previous step drew on the device, never seen by the host), else `host_ids[i]`. No sync."""
    drawn = prior.index_select(0, token_from.clamp(min=0))  # [B]
    return torch.where(token_from >= 0, drawn, host_ids, out=out)


def bucket_sizes(max_batch: int) -> list[int]:
    return [b for b in _LADDER if b < max_batch] + [max_batch]


class WholeModelGraphs:
    """A bucket's decode step as one graph of `model.forward` (DecodeGraphs' default strategy).
    Strategy interface: `capture(b, batch, logits)`, `replay(b, kv_used)` and
    `eager(b, batch, logits, kv_used)` (capture=False: the same step run directly); `batch` is
    the bucket's view of the static buffers, `logits` its head of the shared logits buffer and
    `kv_used` how many leading `kv_indices` entries the step filled."""

    def __init__(self, model, caches: ModelCaches, device: torch.device) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def capture(self, b: int, batch: ForwardBatch, logits: torch.Tensor) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile Triton kernels and settle allocations first
            for _ in range(2):
                self.model.forward(batch, self.caches, logits_out=logits)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.model.forward(batch, self.caches, logits_out=logits)  # [b, V]
        self._pool = graph.pool()
        self.graphs[b] = graph

    def replay(self, b: int, kv_used: int) -> None:
        self.graphs[b].replay()

    def eager(self, b: int, batch: ForwardBatch, logits: torch.Tensor, kv_used: int) -> torch.Tensor:
        return self.model.forward(batch, self.caches, logits_out=logits)


class DecodeGraphs:
    def __init__(self, model, caches: ModelCaches, device: torch.device, *, replay: bool, max_batch: int,
                 pad_state_slot: int, pad_kv_slot: int, ctx_cap: int, capture: bool = True,
                 forward=None) -> None:
        """`forward`: how a bucket is captured and replayed (default `WholeModelGraphs`)."""
        self.model, self.caches, self.device, self.replay = model, caches, device, replay
        self.forward = forward or WholeModelGraphs(model, caches, device)
        self.replays = 0  # steps served by the static buffers (graph replays, or eager when capture=False)
        self.sizes = bucket_sizes(max_batch)
        self.pad_state_slot, self.pad_kv_slot, self.ctx_cap = pad_state_slot, pad_kv_slot, ctx_cap
        self.capture = capture
        b_max = self.sizes[-1]

        def buffer(n: int, dtype=torch.int64) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        self.input_ids = buffer(b_max)                      # [B_max]
        self.positions = buffer(b_max)                      # [B_max]
        self.state_slots = buffer(b_max)                    # [B_max]
        self.out_kv_slots = buffer(b_max)                   # [B_max]
        self.kv_indptr = buffer(b_max + 1, torch.int32)     # [B_max + 1]
        self.shared_with_prev = buffer(b_max, torch.int32)  # [B_max] 0: share nothing (pad rows too)
        self.kv_indices = buffer(b_max * ctx_cap)           # [B_max · ctx_cap]
        self.cu_seqlens = torch.arange(b_max + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(b_max, dtype=torch.int64, device=device)
        # Every bucket's graph writes its logits into the head of this one buffer (allocated
        # outside the graphs' pool): a graph's output tensor stays alive for its replays, so
        # per-bucket outputs would each hold their own [b, V] fp32 (Qwen3.5-27B, buckets up to
        # 256: 1.25 GiB against 0.24 GiB shared). A step's logits are consumed before the next.
        self.logits = torch.empty(b_max, model.config.vocab_size, dtype=torch.float32, device=device)  # [B_max, V]

    @property
    def _graphs(self) -> dict:
        return self.forward.graphs

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b], cu_seqlens=self.cu_seqlens[:b + 1],
            is_decode=True, state_slots=self.state_slots[:b], out_kv_slots=self.out_kv_slots[:b],
            kv_indices=self.kv_indices[:b * self.ctx_cap], kv_indptr=self.kv_indptr[:b + 1],
            logits_indices=self.logits_indices[:b], replay=self.replay, shared_with_prev=self.shared_with_prev[:b])

    def _point_at_scratch(self) -> None:
        """Every row a padding row: warm-up and capture runs then touch scratch slots only."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.state_slots.fill_(self.pad_state_slot)
        self.out_kv_slots.fill_(self.pad_kv_slot)
        self.kv_indices.fill_(self.pad_kv_slot)
        self.kv_indptr.copy_(torch.arange(self.kv_indptr.numel(), dtype=torch.int32))
        self.shared_with_prev.zero_()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool)."""
        if not self.capture:
            return
        self._point_at_scratch()
        for b in reversed(self.sizes):
            self.forward.capture(b, self._batch(b), self.logits[:b])
        torch.cuda.synchronize(self.device)
        log.info("captured decode graphs for batch sizes %s", self.sizes)

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], positions: Sequence[int], state_slots: Sequence[int],
            kv_indices: torch.Tensor, token_from: Optional[Sequence[int]] = None,
            prior_tokens: Optional[torch.Tensor] = None,
            shared_with_prev: Optional[Sequence[int]] = None) -> Optional[torch.Tensor]:
        """Logits [B, V] of one decode step, or None when it does not fit (run it eagerly).
        `kv_indices` [Σ(positions + 1)]: each sequence's whole context in turn, new token last;
        `token_from` / `prior_tokens`: rows whose token is still on the device; `shared_with_prev`:
        KV positions each row shares with the one before (DecodeRows)."""
        B = len(token_ids)
        b = next((s for s in self.sizes if s >= B), None)
        total = kv_indices.numel() + (0 if b is None else b - B)
        if b is None or total > b * self.ctx_cap:
            return None
        pad = b - B
        pad_slots = torch.full((pad,), self.pad_kv_slot, dtype=torch.int64)  # padded rows' one-slot contexts
        from_device = prior_tokens is not None
        rows = torch.tensor([list(token_ids) + [0] * pad, list(positions) + [0] * pad,
                             list(state_slots) + [self.pad_state_slot] * pad,
                             list(token_from) + [-1] * pad if from_device else [-1] * b,
                             list(shared_with_prev or [0] * B) + [0] * pad], dtype=torch.int64)  # [5, b]
        indptr = torch.zeros(b + 1, dtype=torch.int64)
        torch.cumsum(rows[1] + 1, 0, out=indptr[1:])  # padded rows: position 0, one (pad) slot   # [b+1]
        new_kv = torch.cat([kv_indices[indptr[1:B + 1] - 1], pad_slots])  # [b] each new token's slot ends its context
        # One pinned upload (the contexts, the step's biggest part, copied once on the host), then
        # device-side copies into the static buffers (no host wait).
        ids, pos, slots, source, shared, out_kv, ptr, ctx, ctx_pad = upload_packed(
            [*rows, new_kv, indptr, kv_indices, pad_slots], self.device)
        self.input_ids[:b].copy_(ids)
        self.positions[:b].copy_(pos)
        self.state_slots[:b].copy_(slots)
        self.out_kv_slots[:b].copy_(out_kv)
        self.kv_indptr[:b + 1].copy_(ptr)  # int64 → int32 on the device
        self.kv_indices[:kv_indices.numel()].copy_(ctx)
        self.kv_indices[kv_indices.numel():total].copy_(ctx_pad)
        self.shared_with_prev[:b].copy_(shared)  # int64 → int32 on the device
        if from_device:
            select_tokens(self.input_ids[:b], source, prior_tokens, out=self.input_ids[:b])
        self.replays += 1
        if not self.capture:
            return self.forward.eager(b, self._batch(b), self.logits[:b], total)[:B]
        self.forward.replay(b, total)
        return self.logits[:B]
