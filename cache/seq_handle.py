"""What one running sequence holds in the cache: KV slots, state slots, a lock — and a read-only
reference to its token ids, which the sequence owns."""
from __future__ import annotations

from array import array
from typing import Hashable, Optional, Sequence

import torch

from .radix_node import RadixNode


class SeqHandle:
    """The cache's record of one running sequence (created by `StateCache.admit`).

    Read-only for the engine; only `StateCache` methods change it.
    - `tokens`: the sequence's own token list, by reference (given to `admit`; never copied or
      written by the cache). Its owner appends to it; the cache reads ids from it only where it
      inserts into the tree (`donate`, `finish`) or looks a position up (`expect_followers`).
    - `num_tokens`: how many leading tokens have KV slots (the prompt at admission, then one per
      `append`ed token). It may run ahead of `tokens` (a token fed while still on the device: its
      slot exists, its id is not known yet) or behind it (a token drawn, not yet fed): the two
      meet again before the cache reads those ids.
    - `kv_indices`: [num_tokens] int64 CPU, the KV slot of each token. Slots in [0, tree_len) are
      owned by the radix tree (borrowed under the tree lock); the rest belong to the sequence.
      The tensor may be replaced by `append`, `donate` and `track`: re-read it before each step.
    - `working_slot`: the GDN state slot the model reads and updates for this sequence.
    - `resume_len`: tokens reused from the cache at admission (their KV and state were already
      there): the model must compute tokens[resume_len:] only. Its `cached_tokens`.
    - `matched_kv_len`: tokens whose KV matched at admission (>= resume_len; the excess was discarded).
    - `filled_tracks`: extra_buffer snapshots not yet donated: (position, slot) pairs, oldest
      first. Usually empty: a snapshot's slot is allocated by `track` and handed to the tree by
      the next `donate`; a running sequence otherwise holds its working slot only.
    - `ring_cursor`: ReplaySSM only, the host mirror of the working slot's cursor (pending ring
      entries): 0 at admission (the working state was copied folded, or zeroed), moved by
      `StateCache.ring_steps` after each decode step, so folds are counted without a device read.
    """

    def __init__(self, key: Hashable, tokens: Sequence[int], kv_indices: torch.Tensor, working_slot: int,
                 locked_node: Optional[RadixNode], resume_len: int, matched_kv_len: int) -> None:
        self.key = key
        self.tokens = tokens  # the owner's list: read here, never written
        self._num_kv = kv_indices.numel()
        # KV slots live in a Python int64 array with a tensor view on the same memory: decode
        # appends one slot per step (an array store, ~50x cheaper than a tensor store) and
        # `pack_kv` joins many sequences' slots as bytes; everything else uses the tensor view.
        self._kv_buf, self._kv = _kv_buffer(max(16, 2 * self._num_kv))  # grows by doubling
        self._kv[:self._num_kv] = kv_indices
        self.working_slot = working_slot
        self.filled_tracks: list[tuple[int, int]] = []
        self.ring_cursor = 0
        self.locked_node = locked_node
        self.tree_len = resume_len
        self.resume_len = resume_len
        self.matched_kv_len = matched_kv_len

    @property
    def num_tokens(self) -> int:
        return self._num_kv

    @property
    def kv_indices(self) -> torch.Tensor:
        return self._kv[:self._num_kv]  # [num_tokens]

    @property
    def owned_kv(self) -> torch.Tensor:
        """KV slots this sequence owns (not the tree's)."""
        return self._kv[self.tree_len:self._num_kv]

    def state_slots(self) -> list[int]:
        """Every state slot this sequence owns."""
        return [self.working_slot, *(slot for _, slot in self.filled_tracks)]

    def _reserve(self, total: int) -> None:
        """Room for `total` tokens; a bigger buffer replaces the old one (never resized in place:
        tensors viewing the old one stay valid)."""
        if total > len(self._kv_buf):
            n = self._num_kv
            self._kv_buf, grown = _kv_buffer(max(2 * len(self._kv_buf), total))
            grown[:n] = self._kv[:n]
            self._kv = grown

    def _extend(self, kv: torch.Tensor) -> None:
        n, k = self._num_kv, kv.numel()
        self._reserve(n + k)
        self._kv[n:n + k] = kv
        self._num_kv = n + k

    def _append_one(self, kv_slot: int) -> None:
        """`_extend` for a single slot, without building tensors (the decode hot path)."""
        n = self._num_kv
        self._reserve(n + 1)
        self._kv_buf[n] = kv_slot
        self._num_kv = n + 1

    def _adopt_prefix(self, kv: torch.Tensor) -> None:
        """Use the tree's slots for the first len(kv) tokens (after they were inserted)."""
        self._kv[:kv.numel()] = kv

    def _truncate(self, length: int) -> torch.Tensor:
        """Forget the KV slots past `length` tokens; returns them (the caller frees them)."""
        dropped = self._kv[length:self._num_kv].clone()
        self._num_kv = min(self._num_kv, length)
        return dropped


def _kv_buffer(capacity: int) -> tuple[array, torch.Tensor]:
    buffer = array("q", bytes(8 * capacity))
    return buffer, torch.frombuffer(buffer, dtype=torch.int64)  # [capacity], shares the memory


def pack_kv(handles: Sequence[SeqHandle]) -> torch.Tensor:
    """Every handle's `kv_indices`, concatenated: [Σ num_tokens] int64 CPU. One join of raw memory
    instead of a slice and a concatenation per sequence (a decode step's whole context)."""
    # bytearray.join: one copy, writable (torch.frombuffer wants that), where bytes.join + bytearray made two.
    joined = bytearray().join([memoryview(h._kv_buf)[:h._num_kv] for h in handles])  # raw memory
    if not joined:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(joined, dtype=torch.int64)
