"""The radix tree's nodes and what its calls return (`cache/radix_tree.py` is the tree).

A node owns the KV slots of its edge and at most one GDN state slot (a state snapshot valid at
exactly its depth); the results say which slots changed hands.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

EMPTY_KV = torch.empty(0, dtype=torch.int64)  # no KV slots: the root's edge, nothing freed


@dataclass(eq=False)
class RadixNode:
    """An edge of token ids ending at `depth`, with one KV slot per token (shared by all
    attention layers) and optionally a GDN state slot valid at exactly `depth` tokens."""

    tokens: tuple[int, ...]
    kv: torch.Tensor                       # [len(tokens)] int64, CPU
    parent: Optional["RadixNode"]
    depth: int                             # tokens from the root through the end of this edge
    children: dict[int, "RadixNode"] = field(default_factory=dict)  # keyed by first token
    state_slot: Optional[int] = None
    lock_ref: int = 0                      # locks held on this node or any descendant
    state_pins: int = 0                    # admissions copying this node's state right now
    followers: int = 0                     # planned admissions still to resume from this state
    last_access: int = 0                   # logical clock of the last insert/lock through it
    heap_version: int = 0                  # its current entry in the tree's leaf heap (older ones are stale)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class MatchResult:
    """What the cache holds for a token sequence.

    kv_len: leading tokens whose KV is cached; kv_indices: their slots [kv_len].
    state_node / state_slot: the deepest node on the matched path that has a state and ends at
    most at len(tokens) - 1 (None when there is none); resume_len: its depth (0 without one).
    A forward pass can resume only at resume_len: KV in [resume_len, kv_len) is unusable.
    The cap keeps at least one token to compute, which yields the next-token logits.
    """

    kv_len: int
    kv_indices: torch.Tensor
    state_node: Optional[RadixNode]
    state_slot: Optional[int]
    resume_len: int


@dataclass(frozen=True)
class InsertResult:
    """node: the node ending exactly at len(tokens) (the root for no tokens).
    kv_indices: the tree's slots for all the inserted tokens [len(tokens)] — the caller should
    use these from now on. dup_kv: the caller's slots the tree did not take (it already held
    those tokens under other slots): the caller must free them. unused_state: the caller's state
    slot when the node already had one (or the tokens were empty): still the caller's."""

    node: RadixNode
    kv_indices: torch.Tensor
    dup_kv: torch.Tensor
    unused_state: Optional[int]


@dataclass(frozen=True)
class Evicted:
    """Slots the tree gave up; the caller returns them to the pools."""

    kv_indices: torch.Tensor               # int64, CPU
    state_slots: tuple[int, ...]
