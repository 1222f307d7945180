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

from batchinfer.engine.cuda_graphs import DecodeGraphs
from batchinfer.models.forward_batch import ForwardBatch, ModelCaches


@dataclass(frozen=True)
class SequenceChunk:
    token_ids: Sequence[int]      # new tokens of this step
    start: int                    # absolute position of the first new token
    state_slot: int               # GDN working slot (holds the state at `start`)
    context_kv: torch.Tensor      # [start + len(token_ids)] int64 CPU: KV slots of the whole context
    wants_logits: bool            # the chunk ends where a token is to be sampled


def _pinned(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def build_forward_batch(chunks: Sequence[SequenceChunk], *, is_decode: bool, replay: bool,
                        device: torch.device) -> ForwardBatch:
    """Pack chunks (in order) into one varlen batch; logits only for chunks that want them."""
    lengths = [len(c.token_ids) for c in chunks]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)          # [T]
    positions = torch.cat([torch.arange(c.start, c.start + n, dtype=torch.int64)
                           for c, n in zip(chunks, lengths)])                                        # [T]
    kv_indices = torch.cat([c.context_kv for c in chunks])                                          # [Σctx]
    kv_indptr = torch.tensor([0] + [c.context_kv.numel() for c in chunks], dtype=torch.int64).cumsum(0)
    out_kv = torch.cat([c.context_kv[c.start:] for c in chunks])                                    # [T]
    logits_indices = torch.tensor([cu[i + 1] - 1 for i, c in enumerate(chunks) if c.wants_logits],
                                  dtype=torch.int64)                                                 # [N]
    return ForwardBatch(
        input_ids=_pinned(input_ids, device),
        positions=_pinned(positions, device),
        cu_seqlens=_pinned(torch.tensor(cu, dtype=torch.int32), device),
        is_decode=is_decode,
        state_slots=_pinned(torch.tensor([c.state_slot for c in chunks], dtype=torch.int64), device),
        out_kv_slots=_pinned(out_kv, device),
        kv_indices=_pinned(kv_indices, device),
        kv_indptr=_pinned(kv_indptr.to(torch.int32), device),
        logits_indices=_pinned(logits_indices, device),
        replay=replay and is_decode,
    )


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
        """Logits [N, V] fp32 for the chunks that want them (in chunk order)."""
        batch = build_forward_batch(chunks, is_decode=False, replay=False, device=self.device)
        return self.model.forward(batch, self.caches)

    @torch.inference_mode()
    def decode(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """One token per chunk, every chunk wants logits: [B, V] fp32.

        Under ReplaySSM the model advances each slot's ring cursor (docs/MODULES.md)."""
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run([c.token_ids[0] for c in chunks], [c.start for c in chunks],
                                           [c.state_slot for c in chunks], [c.context_kv for c in chunks])
            if logits is not None:
                return logits  # a view of the graph's output: consume before the next step
        batch = build_forward_batch(chunks, is_decode=True, replay=self.replay, device=self.device)
        return self.model.forward(batch, self.caches)
