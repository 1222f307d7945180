"""Ownership audit of a whole StateCache: the invariant every other cache module relies on.

Every KV slot and every state slot is owned by exactly one holder at all times — a running
sequence, the radix tree, or the pool's free list — and the tree's lock counts are exactly
the locks held. A violation here is what becomes, much later and far away, two sequences
writing one slot or a cached prefix silently evicted under a running request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .radix_node import RadixNode
    from .state_cache import StateCache


def audit_state_cache(cache: "StateCache", external_locks: Sequence["RadixNode"] = ()) -> None:
    """Raise AssertionError unless ownership and lock counts are consistent (see module doc)."""
    cache.kv_pool.audit()
    cache.state_pool.audit()
    cache.tree.audit()
    running = cache.running
    tree_kv = cache.tree.owned_kv()
    kv_owners = torch.cat([tree_kv] + [seq.owned_kv for seq in running])
    _assert_exactly_owned(kv_owners, cache.kv_pool.allocated_mask(), "KV slot")
    state_owners = cache.tree.owned_states() + [slot for seq in running for slot in seq.state_slots()]
    _assert_exactly_owned(torch.tensor(state_owners, dtype=torch.int64), cache.state_pool.allocated_mask(),
                          "state slot")

    in_tree = torch.zeros(cache.kv_pool.num_slots, dtype=torch.bool)
    in_tree[tree_kv] = True
    for seq in running:
        assert bool(in_tree[seq.kv_indices[:seq.tree_len]].all()), "borrowed KV not held by the tree"
        node = seq.locked_node
        assert (node is None) == (seq.tree_len == 0), "a sequence borrows tree KV without a lock (or vice versa)"
        assert node is None or node.depth == seq.tree_len, "a sequence's lock is not where its tree part ends"

    expected: dict[int, int] = {}
    for node in [seq.locked_node for seq in running] + list(external_locks):
        while node is not None and node is not cache.tree.root:
            expected[id(node)] = expected.get(id(node), 0) + 1
            node = node.parent
    for node in cache.tree.nodes():
        assert node.lock_ref == expected.get(id(node), 0), "tree lock count != locks actually held"


def _assert_exactly_owned(owned: torch.Tensor, allocated: torch.Tensor, what: str) -> None:
    """`owned` lists every holder's indices; each allocated index must appear exactly once."""
    if owned.numel() and (int(owned.min()) < 0 or int(owned.max()) >= allocated.numel()):
        raise AssertionError(f"{what} index out of range")
    counts = torch.bincount(owned, minlength=allocated.numel())
    assert int(counts.max()) <= 1, f"a {what} has two owners"
    assert torch.equal(counts.bool(), allocated), f"a {what} is allocated but unowned, or owned but free"
