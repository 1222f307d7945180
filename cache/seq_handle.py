"""What one running sequence holds in the cache: token ids, KV slots, state slots, a lock."""
from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from .radix_tree import RadixNode


class SeqHandle:
    """The cache's record of one running sequence (created by `StateCache.admit`).

    Read-only for the engine; only `StateCache` methods change it.
    - `tokens`: every token the sequence has KV slots for (prompt, then appended tokens), in order.
    - `kv_indices`: [len(tokens)] int64 CPU, the KV slot of each token. Slots in [0, tree_len) are
      owned by the radix tree (borrowed under the tree lock); the rest belong to the sequence.
      The tensor may be replaced by `append`, `donate` and `track`: re-read it before each step.
    - `working_slot`: the GDN state slot the model reads and updates for this sequence.
    - `resume_len`: tokens reused from the cache at admission (their KV and state were already
      there): the model must compute tokens[resume_len:] only. Its `cached_tokens`.
    - `matched_kv_len`: tokens whose KV matched at admission (>= resume_len; the excess was discarded).
    - `filled_tracks`: extra_buffer snapshots not yet donated: (position, slot) pairs, oldest
      first. Usually empty: a snapshot's slot is allocated by `track` and handed to the tree by
      the next `donate`; a running sequence otherwise holds its working slot only.
    """

    def __init__(self, key: Hashable, tokens: Sequence[int], kv_indices: torch.Tensor, working_slot: int,
                 locked_node: Optional[RadixNode], resume_len: int, matched_kv_len: int) -> None:
        self.key = key
        self.tokens: list[int] = list(tokens)
        self._kv = torch.empty(max(16, 2 * len(self.tokens)), dtype=torch.int64)  # grows by doubling
        self._kv[:len(self.tokens)] = kv_indices
        self.working_slot = working_slot
        self.filled_tracks: list[tuple[int, int]] = []
        self.locked_node = locked_node
        self.tree_len = resume_len
        self.resume_len = resume_len
        self.matched_kv_len = matched_kv_len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def kv_indices(self) -> torch.Tensor:
        return self._kv[:len(self.tokens)]  # [num_tokens]

    @property
    def owned_kv(self) -> torch.Tensor:
        """KV slots this sequence owns (not the tree's)."""
        return self._kv[self.tree_len:len(self.tokens)]

    def state_slots(self) -> list[int]:
        """Every state slot this sequence owns."""
        return [self.working_slot, *(slot for _, slot in self.filled_tracks)]

    def _extend(self, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        n, k = len(self.tokens), len(token_ids)
        if n + k > self._kv.numel():
            grown = torch.empty(max(2 * self._kv.numel(), n + k), dtype=torch.int64)
            grown[:n] = self._kv[:n]
            self._kv = grown
        self._kv[n:n + k] = kv
        self.tokens.extend(int(t) for t in token_ids)

    def _adopt_prefix(self, kv: torch.Tensor) -> None:
        """Use the tree's slots for the first len(kv) tokens (after they were inserted)."""
        self._kv[:kv.numel()] = kv

    def _truncate(self, length: int) -> torch.Tensor:
        """Forget tokens past `length`; returns their KV slots (the caller frees them)."""
        dropped = self._kv[length:len(self.tokens)].clone()
        del self.tokens[length:]
        return dropped
