"""Host ⇄ device copies that never wait for the GPU.

A plain `tensor.to("cuda")` from ordinary (pageable) host memory waits until everything queued
on the stream has run, and so does `torch.tensor(..., device="cuda")`: the copy is staged
synchronously. With decode steps kept in flight (engine overlap) that wait would serialise the
host with the GPU again, so every per-step upload goes through pinned memory (torch's caching
host allocator reuses its blocks) and every download lands in pinned memory behind an event.
"""
from __future__ import annotations

from typing import Optional

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued without waiting for the device."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def upload_packed(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """1-D host tensors of one dtype → device views, in one transfer (each small copy costs a launch)."""
    packed = upload(torch.cat(parts), device)
    return list(packed.split([p.numel() for p in parts]))


class Download:
    """A device tensor's values on their way to the host: start now, read when needed."""

    def __init__(self, t: torch.Tensor) -> None:
        self._event: Optional[torch.cuda.Event] = None
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t

    def tolist(self) -> list:
        """Waits for the copy (and the work queued before it) only."""
        return self.tensor().tolist()

    def tensor(self) -> torch.Tensor:
        """The host tensor, once the copy has landed (waits for it only)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
