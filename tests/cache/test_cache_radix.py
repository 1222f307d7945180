"""RadixTree: match / insert / split / lock / evict ordering."""
from __future__ import annotations

import pytest
import torch

from batchinfer.cache.radix_tree import RadixTree


def _kv(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def test_match_on_empty_tree():
    m = RadixTree().match([1, 2, 3])
    assert (m.kv_len, m.resume_len, m.state_node, m.state_slot) == (0, 0, None, None)
    assert m.kv_indices.numel() == 0


def test_insert_then_match_partial_edge_counts_kv_not_state():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5], _kv(10, 5), state_slot_at_end=7)
    m = tree.match([1, 2, 3, 9])
    assert m.kv_len == 3 and m.kv_indices.tolist() == [10, 11, 12]
    assert m.state_node is None and m.resume_len == 0  # the state is valid at depth 5 only


def test_resume_is_deepest_state_capped_below_full_length():
    tree = RadixTree()
    tree.insert([1, 2, 3], _kv(0, 3), state_slot_at_end=0)
    tree.insert([1, 2, 3, 4, 5, 6], _kv(0, 6), state_slot_at_end=1)
    m = tree.match([1, 2, 3, 4, 5, 6, 7])
    assert (m.resume_len, m.state_slot, m.kv_len) == (6, 1, 6)
    # The whole prompt is cached with a state at its end: still one token must be computed.
    m = tree.match([1, 2, 3, 4, 5, 6])
    assert (m.resume_len, m.state_slot, m.kv_len) == (3, 0, 6)
    m = tree.match([1, 2, 3])
    assert (m.resume_len, m.state_slot) == (0, None)


def test_insert_splits_and_reports_duplicates():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _kv(0, 4))
    res = tree.insert([1, 2, 7, 8], torch.tensor([0, 1, 50, 51]))  # first two borrowed: not duplicates
    assert res.dup_kv.numel() == 0 and res.kv_indices.tolist() == [0, 1, 50, 51]
    res = tree.insert([1, 2, 7, 8, 9], torch.tensor([60, 61, 62, 63, 64]))
    assert sorted(res.dup_kv.tolist()) == [60, 61, 62, 63]  # the tree already held tokens 0..3
    assert res.kv_indices.tolist() == [0, 1, 50, 51, 64]
    assert tree.num_kv_tokens == 7
    tree.audit()
    split = tree.match([1, 2]).kv_len
    assert split == 2 and len(tree.root.children[1].children) == 2  # [1,2] then {3,4} and {7,8,...}


def test_inner_state_splits_edge_and_existing_state_is_kept():
    tree = RadixTree()
    leaf = tree.insert([5, 6, 7, 8, 9], _kv(0, 5), state_slot_at_end=3).node
    res = tree.insert([5, 6, 7], _kv(0, 3), state_slot_at_end=4)  # donation at an inner position
    assert res.unused_state is None and res.node.depth == 3 and res.node.state_slot == 4
    assert leaf.parent is res.node and leaf.state_slot == 3 and leaf.tokens == (8, 9)
    again = tree.insert([5, 6, 7], _kv(0, 3), state_slot_at_end=5)
    assert again.unused_state == 5 and again.node is res.node
    assert tree.num_states == 2
    assert tree.insert([], _kv(0, 0), state_slot_at_end=6).unused_state == 6  # no state at the root
    tree.audit()


def test_match_does_not_mutate():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _kv(0, 4), state_slot_at_end=0)
    before = [(n.tokens, n.last_access, n.lock_ref) for n in tree.nodes()]
    tree.match([1, 2, 9])
    tree.match([1, 2, 3, 4, 5])
    assert [(n.tokens, n.last_access, n.lock_ref) for n in tree.nodes()] == before


def test_split_preserves_locks():
    tree = RadixTree()
    node = tree.insert([1, 2, 3, 4], _kv(0, 4)).node
    tree.lock(node)
    upper = tree.insert([1, 2], _kv(0, 2)).node  # splits the locked edge
    assert upper.lock_ref == 1 and node.lock_ref == 1
    tree.unlock(node)
    assert upper.lock_ref == 0 and node.lock_ref == 0
    with pytest.raises(RuntimeError):
        tree.unlock(node)


def test_evict_kv_past_last_state_first_even_if_recent():
    tree = RadixTree()
    tree.insert([1, 2, 3], _kv(0, 3), state_slot_at_end=0)          # older, has a state
    tree.insert([7, 8, 9, 10], _kv(10, 4))                           # newer, no state: useless KV
    ev = tree.evict(num_kv_tokens=2)
    assert sorted(ev.kv_indices.tolist()) == [12, 13] and ev.state_slots == ()  # tail trimmed
    assert tree.match([7, 8, 9, 10]).kv_len == 2
    ev = tree.evict(num_kv_tokens=3)
    # The rest of the stateless leaf (2 tokens) goes first, then the LRU stateful leaf, whole.
    assert sorted(ev.kv_indices.tolist()) == [0, 1, 2, 10, 11] and ev.state_slots == (0,)
    assert tree.num_kv_tokens == 0 and tree.num_states == 0
    tree.audit()


def test_evict_lru_order_and_locks_respected():
    tree = RadixTree()
    a = tree.insert([1, 1], _kv(0, 2), state_slot_at_end=0).node
    b = tree.insert([2, 2], _kv(2, 2), state_slot_at_end=1).node
    c = tree.insert([3, 3], _kv(4, 2), state_slot_at_end=2).node
    tree.lock(a)  # a is the most recently used now, and locked
    ev = tree.evict(num_kv_tokens=1)
    assert ev.state_slots == (1,)  # b: least recently used unlocked
    ev = tree.evict(num_kv_tokens=100)
    assert ev.state_slots == (2,) and tree.match([1, 1, 5]).resume_len == 2
    assert tree.evictable() == (0, 1)  # a's KV is locked; its state is not (only a pin keeps it)
    tree.unlock(a)
    assert tree.evictable() == (2, 1)
    del c


def test_locked_node_loses_its_state_but_never_its_kv():
    tree = RadixTree()
    inner = tree.insert([1, 2, 3], _kv(0, 3), state_slot_at_end=0).node
    locked = tree.insert([1, 2, 3, 4, 5], _kv(0, 5), state_slot_at_end=1).node
    free = tree.insert([7, 7], _kv(10, 2), state_slot_at_end=2).node
    tree.lock(locked)  # a running sequence on [1..5]: inner and locked are on its path
    assert tree.evictable() == (2, 3)
    ev = tree.evict(num_kv_tokens=0, num_states=1)
    assert ev.state_slots == (2,)  # the unlocked state goes first, although used most recently
    ev = tree.evict(num_kv_tokens=0, num_states=5)
    assert sorted(ev.state_slots) == [0, 1] and inner.state_slot is None and locked.state_slot is None
    ev = tree.evict(num_kv_tokens=100)
    assert sorted(ev.kv_indices.tolist()) == [10, 11]  # the unlocked leaf; the locked path stays
    assert tree.match([1, 2, 3, 4, 5, 6]).kv_len == 5 and tree.num_kv_tokens == 5
    tree.audit()


def test_pinned_state_survives_eviction_until_unpinned():
    tree = RadixTree()
    node = tree.insert([4, 4, 4], _kv(0, 3), state_slot_at_end=7).node
    with pytest.raises(RuntimeError):
        tree.pin_state(node)  # pins need a lock (the KV must stay too)
    tree.lock(node)
    tree.pin_state(node)
    assert tree.evictable() == (0, 0)
    assert tree.evict(num_kv_tokens=10, num_states=10).state_slots == ()
    tree.unpin_state(node)
    tree.audit()
    assert tree.evictable() == (0, 1) and tree.evict(0, 1).state_slots == (7,)
    with pytest.raises(RuntimeError):
        tree.unpin_state(node)
    tree.unlock(node)
    tree.audit()


def test_states_evicted_before_kv_and_inner_states_evictable():
    tree = RadixTree()
    tree.insert([1, 2, 3], _kv(0, 3), state_slot_at_end=0)
    tree.insert([1, 2, 3, 4, 5], _kv(0, 5), state_slot_at_end=1)
    ev = tree.evict(num_kv_tokens=0, num_states=1)
    assert ev.state_slots == (0,) and ev.kv_indices.numel() == 0  # the inner (older) state goes, KV stays
    m = tree.match([1, 2, 3, 4, 5, 6])
    assert m.kv_len == 5 and m.resume_len == 5
    ev = tree.evict(num_kv_tokens=0, num_states=1)
    assert ev.state_slots == (1,) and tree.match([1, 2, 3, 4, 5, 6]).resume_len == 0
    # A leaf whose state went is now KV past the last state: it is the first KV to go.
    tree.insert([9, 9, 9], _kv(20, 3), state_slot_at_end=2)
    ev = tree.evict(num_kv_tokens=2)
    assert sorted(ev.kv_indices.tolist()) == [3, 4] and ev.state_slots == ()
    tree.audit()


def test_eviction_cascades_to_parent_that_becomes_leaf():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _kv(0, 4))
    tree.insert([1, 2, 5, 6], torch.tensor([0, 1, 8, 9]))
    ev = tree.evict(num_kv_tokens=6)
    assert sorted(ev.kv_indices.tolist()) == [0, 1, 2, 3, 8, 9]
    assert tree.num_kv_tokens == 0 and not tree.root.children


def test_node_at_finds_exact_node_boundaries_only():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _kv(0, 4))
    tree.insert([1, 2, 7], _kv(10, 3))  # splits after [1, 2]
    assert tree.node_at([1, 2, 3, 4], 2).depth == 2
    assert tree.node_at([1, 2, 3, 4, 9], 4).depth == 4
    assert tree.node_at([1, 2, 3, 4], 3) is None      # inside an edge
    assert tree.node_at([1, 2, 5, 5], 4) is None      # off the tree
    assert tree.node_at([1, 2], 0) is None and tree.node_at([1, 2], 3) is None


def test_states_with_expected_followers_are_evicted_last_and_spared_on_request():
    tree = RadixTree()
    branch = tree.insert([1, 2, 3], _kv(0, 3), state_slot_at_end=0).node   # oldest: LRU's first pick
    tree.insert([5, 6], _kv(3, 2), state_slot_at_end=1)
    tree.insert([5, 6, 7], _kv(3, 3), state_slot_at_end=2)
    tree.expect_followers(branch, 2)
    tree.audit()
    assert tree.evictable() == (6, 3) and tree.evictable(spare_expected=True) == (6, 2)
    assert tree.evict(0, 1).state_slots == (1,)                     # not the older branch state
    assert tree.evict(0, 5, spare_expected=True).state_slots == (2,)  # spared entirely
    tree.follower_admitted(branch)
    assert tree.evictable(spare_expected=True) == (6, 0)
    tree.follower_admitted(branch)
    tree.follower_admitted(branch)  # more admissions than expected: a no-op, never negative
    assert branch.followers == 0 and tree.evictable(spare_expected=True) == (6, 1)
    tree.audit()


def test_evicting_a_state_with_followers_forgets_them():
    tree = RadixTree()
    branch = tree.insert([1, 2, 3], _kv(0, 3), state_slot_at_end=4).node
    tree.expect_followers(branch, 3)
    with pytest.raises(RuntimeError):
        tree.expect_followers(tree.insert([8], _kv(9, 1)).node, 1)  # no state there
    assert tree.evict(0, 1).state_slots == (4,)  # last resort: nothing else to evict
    assert branch.followers == 0
    tree.audit()
    # Leaves: the leaf whose state has followers goes after a stateful leaf without.
    branch = tree.insert([1, 2, 3], _kv(0, 3), state_slot_at_end=5).node
    tree.insert([6, 6], _kv(20, 2), state_slot_at_end=6)
    tree.expect_followers(branch, 1)
    ev = tree.evict(num_kv_tokens=2)
    assert ev.state_slots == (6,) and tree.match([1, 2, 3, 9]).resume_len == 3
    tree.audit()


def test_eviction_order_follows_keys_changed_since_insertion():
    """The leaf heap is kept between evictions: a lock/unlock or a re-insert since a leaf entered
    it must move it, exactly as a heap rebuilt from the current keys would."""
    t = RadixTree()
    a = t.insert([1, 2], _kv(0, 2)).node
    t.insert([3, 4], _kv(10, 2))
    t.insert([5, 6], _kv(20, 2))
    t.insert([7, 8], _kv(30, 2))
    t.lock(a)
    t.unlock(a)  # a: used after c and d
    assert t.insert([3, 4], _kv(10, 2)).dup_kv.numel() == 0  # b: touched last
    t.insert([9, 9], _kv(40, 2), state_slot_at_end=7)  # a leaf with a state goes after stateless ones
    t.audit()
    assert t.evict(1).kv_indices.tolist() == [21]  # c, least recently used: its tail trimmed
    assert t.evict(2).kv_indices.tolist() == [20, 31]  # c's rest, then d's tail
    assert t.evict(1).kv_indices.tolist() == [30]
    assert t.evict(2).kv_indices.tolist() == [0, 1]  # a
    assert t.evict(2).kv_indices.tolist() == [10, 11]  # b
    ev = t.evict(2)
    assert ev.kv_indices.tolist() == [40, 41] and ev.state_slots == (7,)
    t.audit()
    assert t.num_kv_tokens == 0


def test_leaf_heap_rebuilds_change_nothing():
    """Random inserts, locks, unlocks, state evictions and KV evictions on two trees, one that
    rebuilds its leaf heap at nearly every push (even in the middle of an eviction) and one with
    the defaults: the same victims in the same order, and both audits hold after every step."""
    import random

    rng = random.Random(5)
    eager, lazy = RadixTree(), RadixTree()
    eager.heap_rebuild_factor, eager.heap_rebuild_floor = 1, 0
    locks: list[tuple] = []
    next_slot = 0
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
            kv = _kv(next_slot, len(tokens))
            next_slot += len(tokens)
            state = next_slot if rng.random() < 0.3 else None
            nodes = [tree.insert(tokens, kv, state_slot_at_end=state).node for tree in (eager, lazy)]
            if rng.random() < 0.3 and nodes[0] is not eager.root:
                for tree, node in zip((eager, lazy), nodes):
                    tree.lock(node)
                locks.append(tuple(nodes))
        elif op < 0.6 and locks:
            for tree, node in zip((eager, lazy), locks.pop(rng.randrange(len(locks)))):
                tree.unlock(node)
        else:
            num_kv, num_states = rng.randrange(1, 12), rng.randrange(0, 2)
            freed = [tree.evict(num_kv, num_states) for tree in (eager, lazy)]
            assert freed[0].kv_indices.tolist() == freed[1].kv_indices.tolist(), f"step {step}"
            assert freed[0].state_slots == freed[1].state_slots, f"step {step}"
        eager.audit()
        lazy.audit()

