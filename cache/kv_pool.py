"""KV slot pool: token-granular key/value storage for every full-attention layer."""
from __future__ import annotations

from typing import Iterable

import torch

from .shapes import KVShape
from .slot_owner import SlotPool


class KVPool(SlotPool):
    """Preallocated KV cache, one slot per token, one slot index shared by all attention layers.

    Tensors: `k[i]`, `v[i]` of shape [num_slots + 1, H_kv, d] for the i-th attention layer,
    in the model dtype, on `device`. Row `pad_slot` (== num_slots) is a scratch row that is
    never handed out: padded entries of a batch (CUDA-graph padding) may write there freely.

    Contract:
    - `alloc(n)` returns n distinct slot indices (int64 tensor on the CPU) or None when fewer than
      n are free (nothing is taken then). The caller owns them until it passes them to `free`
      (or hands them to the radix tree, which then owns them).
    - `free(idx)` of an index that is not allocated (double free) raises `DoubleFreeError`.
    - Contents of a freshly allocated slot are undefined: the model writes k/v before reading.
    """

    def __init__(self, num_slots: int, shape: KVShape, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        self.device = torch.device(device)
        super().__init__(num_slots)
        rows = (num_slots + 1, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.zeros(rows, dtype=shape.dtype, device=self.device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(rows, dtype=shape.dtype, device=self.device) for _ in range(shape.num_layers)]

    def alloc(self, n: int) -> torch.Tensor | None:
        return self._free.alloc(n)

    def free(self, idx: torch.Tensor | Iterable[int]) -> None:
        self._free.free(idx)
