"""A second CUDA stream for a step's prefill forward, so that it runs beside the step's decode forward.

A prefill chunk is compute-bound (its GEMMs run at the tensor cores' rate) and a decode step is
memory-bound (weights, KV and GDN state streamed once), so run at the same time they can share
the GPU instead of taking turns. The contract that keeps this as correct as two forwards in turn:
- the side stream waits for everything the caller queued before the step (the previous step's
  writes to the pools), so it starts where the first forward would have started;
- the two forwards write disjoint memory: each sequence's own KV slots and GDN working slot, and
  each forward's own transient tensors (allocated on its own stream); what both read (weights,
  shared prefix KV, cached states) nothing writes during the step;
- the caller joins the side stream before anything reads a result, and the tensors handed back
  are marked as used by the caller's stream, so the caching allocator does not give their memory
  to the side stream while the caller still reads them.
The engine then runs every prefill forward on the side stream, with decode rows beside it or not:
the caching allocator keeps each stream's freed blocks for that stream, so prefills alternating
between two streams would hold their activations' memory twice.
On the CPU (no streams) the forwards simply run in turn.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


class SideStream:
    """`launch()` runs its block's GPU work on the side stream; `join(t)` makes the caller's stream
    wait for it and returns `t`, safe to read on the caller's stream."""

    def __init__(self, device: torch.device, priority: int = 0) -> None:
        """`priority`: CUDA's, where lower is more urgent (0, the default stream's, is the least):
        pending blocks of a more urgent stream's kernels are dispatched first as SMs free up."""
        self.device = device
        self.stream: Optional[torch.cuda.Stream] = \
            torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None

    @contextlib.contextmanager
    def launch(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self, result: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            return result
        caller = torch.cuda.current_stream(self.device)
        caller.wait_stream(self.stream)
        result.record_stream(caller)
        return result
