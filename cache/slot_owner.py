"""Free list with ownership: the one place that decides whether an index is free or taken."""
from __future__ import annotations

from typing import Iterable

import torch


class DoubleFreeError(RuntimeError):
    """An index was freed that is not allocated (already free, out of range, or listed twice)."""


class FreeList:
    """Indices 0..capacity-1, each either free or allocated.

    Kept on the CPU as a stack of free indices plus an allocated mask, so `alloc`/`free` are a
    few tensor ops regardless of pool size. Freeing something not allocated raises at once:
    an ownership bug found here is cheap; found as two sequences sharing a slot it is not.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        # Reversed so that alloc hands out low indices first (cosmetic, eases debugging).
        self._stack = torch.arange(capacity - 1, -1, -1, dtype=torch.int64)  # [capacity]
        self._top = capacity  # _stack[:_top] are free
        self._allocated = torch.zeros(capacity, dtype=torch.bool)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_allocated(self) -> int:
        return self.capacity - self._top

    def alloc(self, n: int) -> torch.Tensor | None:
        """n distinct free indices (int64, CPU), now allocated; None (nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > self._top:
            return None
        idx = self._stack[self._top - n:self._top].flip(0)  # flip copies
        self._top -= n
        self._allocated[idx] = True
        return idx

    def free(self, idx: torch.Tensor | Iterable[int]) -> None:
        idx = torch.as_tensor(idx, dtype=torch.int64).reshape(-1).cpu()
        if idx.numel() == 0:
            return
        if int(idx.min()) < 0 or int(idx.max()) >= self.capacity:
            raise DoubleFreeError(f"index out of range 0..{self.capacity - 1}: {idx.tolist()[:8]}")
        if torch.unique(idx).numel() != idx.numel():
            raise DoubleFreeError(f"indices listed twice in one free: {idx.tolist()[:8]}")
        if not bool(self._allocated[idx].all()):
            bad = idx[~self._allocated[idx]].tolist()
            raise DoubleFreeError(f"freeing indices that are not allocated: {bad[:8]}")
        self._allocated[idx] = False
        self._stack[self._top:self._top + idx.numel()] = idx
        self._top += idx.numel()

    def allocated_mask(self) -> torch.Tensor:
        return self._allocated.clone()  # [capacity] bool

    def audit(self) -> None:
        """Free stack and allocated mask agree: every index exactly once, free xor allocated."""
        free = self._stack[:self._top]
        mask = torch.zeros(self.capacity, dtype=torch.int64)
        mask.index_add_(0, free, torch.ones_like(free))
        assert int(mask.max()) <= 1, "an index is on the free list twice"
        assert torch.equal(mask.bool(), ~self._allocated), "free list and allocated mask disagree"


class SlotPool:
    """What every slot pool shares: a `FreeList` of `num_slots` indices plus one scratch row
    (`pad_slot` == num_slots) that is never handed out — padded batch entries (CUDA-graph
    padding) may write there freely. Subclasses add the tensors and `alloc`/`free` signatures."""

    def __init__(self, num_slots: int) -> None:
        self._free = FreeList(num_slots)

    @property
    def num_slots(self) -> int:
        return self._free.capacity

    @property
    def pad_slot(self) -> int:
        return self._free.capacity

    @property
    def num_free(self) -> int:
        return self._free.num_free

    @property
    def num_used(self) -> int:
        return self._free.num_allocated

    def allocated_mask(self) -> torch.Tensor:
        """[num_slots] bool, True where a slot is owned by someone (request or tree)."""
        return self._free.allocated_mask()

    def audit(self) -> None:
        self._free.audit()
