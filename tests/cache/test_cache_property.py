"""Property test: random sequences of cache operations never break slot ownership.

After every step: each KV and state slot is owned exactly once (request, tree or free list;
free + owned = total), the tree's lock counts equal the locks actually held, the KV of locked
nodes is never evicted (their states may be: nothing reads a tree state after admission copied
it), no state stays pinned between calls, a running request holds its working slot plus at most
two undonated snapshots, and `match` resumes exactly at the deepest state on the path (never
deeper, never at the full length) without mutating the tree.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchinfer.cache.cache_config import CacheConfig
from batchinfer.cache.kv_pool import KVPool
from batchinfer.cache.shapes import GdnStateShape, KVShape
from batchinfer.cache.state_cache import StateCache
from batchinfer.cache.state_pool import GdnStatePool

pytestmark = pytest.mark.slow  # a stateful hypothesis search over the cache

# Prompts are a cut of one of a few "documents" plus a short random tail: many shared prefixes.
DOCUMENTS = ((0, 1, 2, 0, 1, 1, 2), (0, 1, 1, 2, 0), (2, 2, 0, 1))
TOKENS = st.builds(lambda doc, cut, tail: list(doc[:cut]) + tail, st.sampled_from(DOCUMENTS),
                   st.integers(0, 7), st.lists(st.integers(0, 2), max_size=3)).filter(bool)


def _deepest_state(tree, tokens) -> int:
    """Independent walk: depth of the deepest fully matched node with a state, below len(tokens)."""
    node, depth, best = tree.root, 0, 0
    while depth < len(tokens):
        child = node.children.get(tokens[depth])
        if child is None or tuple(tokens[depth:depth + len(child.tokens)]) != child.tokens:
            break
        node, depth = child, child.depth
        if node.state_slot is not None and depth <= len(tokens) - 1:
            best = depth
    return best


def _attached(tree, node) -> bool:
    while node is not tree.root:
        if node.parent is None or node.parent.children.get(node.tokens[0]) is not node:
            return False
        node = node.parent
    return True


class CacheMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["extra_buffer", "no_buffer"]), prefix_cache=st.sampled_from([True, True, False]),
                replay=st.booleans(), warmup=st.lists(st.tuples(TOKENS, st.integers(1, 9)), max_size=3),
                state_slots=st.sampled_from([4, 12]))  # 4: tracking often finds the pool all working slots
    def build(self, mode, prefix_cache, replay, warmup, state_slots):
        kv = KVPool(32, KVShape(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32))
        shape = GdnStateShape(num_layers=1, conv_dim=3, conv_kernel=2, num_k_heads=1, num_v_heads=1,
                              head_k_dim=1, head_v_dim=1, conv_dtype=torch.float32, ssm_dtype=torch.float32,
                              ring_len=2 if replay else 0)
        self.cache = StateCache(kv, GdnStatePool(state_slots, shape), CacheConfig(mode=mode, prefix_cache=prefix_cache))
        self.external_locks = []  # (node, depth when locked, edge tokens when locked, edge KV when locked)
        for tokens, position in warmup:  # start from a populated tree: states for later matches to find
            seq = self.cache.admit("warmup", list(tokens))
            self.cache.track(seq, min(position, len(tokens)))
            self.cache.finish(seq)

    def _pick(self, data):
        return data.draw(st.sampled_from(self.cache.running))

    # ---- request lifecycle -----------------------------------------------------------------
    @rule(tokens=TOKENS)
    def admit(self, tokens):
        expected = self.cache.match(tokens)
        seq = self.cache.admit(len(self.cache.running), list(tokens))  # the sequence's own list
        if seq is not None:
            assert seq.resume_len == expected.resume_len  # the reused prefix was locked before evicting
            assert int(self.cache.state_pool.cursor[seq.working_slot]) == 0

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, data, tokens):
        seq = self._pick(data)
        before = seq.num_tokens
        kv = self.cache.append(seq, len(tokens))
        assert seq.num_tokens == before + (0 if kv is None else len(tokens))
        if kv is not None:
            seq.tokens.extend(tokens)  # the owner's list: fed tokens' ids are known (no decode in flight here)

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data())
    def append_many(self, data):
        """A decode step's batched reservation: all sequences grow by one, or none does."""
        seqs = data.draw(st.lists(st.sampled_from(self.cache.running), min_size=1, unique_by=id))
        before = [s.num_tokens for s in seqs]
        ids = [data.draw(st.integers(0, 2)) for _ in seqs]
        grew = self.cache.append_many(seqs)
        assert [s.num_tokens for s in seqs] == [n + grew for n in before]
        for seq, token in zip(seqs, ids if grew else ()):
            seq.tokens.append(token)

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data())
    def track(self, data):
        seq = self._pick(data)
        position = data.draw(st.integers(0, seq.num_tokens))
        skipped = self.cache.stats().tracks_skipped
        if self.cache.track(seq, position):
            position_, slot = seq.filled_tracks[-1]
            assert position_ == position and int(self.cache.state_pool.cursor[slot]) == 0
        elif self.cache.config.tracks and seq.tree_len < position:
            # No slot even after evicting: every slot is a working slot or an undonated snapshot.
            assert self.cache.stats().tracks_skipped == skipped + 1
            assert self.cache.state_pool.num_free == 0 and self.cache.tree.num_states == 0

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), max_size=2))
    def step_track_donate(self, data, tokens):
        """The engine's usual rhythm: feed tokens, snapshot the state where they end, donate it."""
        seq = self._pick(data)
        fed = self.cache.append(seq, len(tokens)) is not None
        if fed:
            seq.tokens.extend(tokens)
        if fed and self.cache.track(seq, seq.num_tokens):
            assert self.cache.donate(seq) == 1 or self.cache.tree.match(seq.tokens + [0]).resume_len \
                == seq.num_tokens  # not taken only because the node already had a state
            assert seq.tree_len == seq.num_tokens

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data())
    def donate(self, data):
        seq = self._pick(data)
        self.cache.donate(seq)
        assert not seq.filled_tracks

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data())
    def finish(self, data):
        seq = self._pick(data)
        self.cache.finish(seq, data.draw(st.none() | st.integers(0, seq.num_tokens)))

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data())
    def abort(self, data):
        self.cache.abort(self._pick(data))

    # ---- pools and tree directly -----------------------------------------------------------
    @precondition(lambda self: len([s for q in self.cache.running for s in q.state_slots()]) >= 2)
    @rule(data=st.data())
    def copy(self, data):
        owned = [s for q in self.cache.running for s in q.state_slots()]
        src, dst = data.draw(st.permutations(owned))[:2]
        self.cache.state_pool.cursor[src] = data.draw(st.integers(0, self.cache.state_pool.shape.ring_len))
        self.cache.state_pool.copy(src, dst)
        assert int(self.cache.state_pool.cursor[dst]) == 0

    @rule(num_kv=st.integers(0, 12), num_states=st.integers(0, 4))
    def evict(self, num_kv, num_states):
        self.cache.evict(num_kv, num_states)

    @rule(num_kv=st.integers(0, 24), num_states=st.integers(0, 10))
    def ensure_free(self, num_kv, num_states):
        if self.cache.ensure_free(num_kv, num_states):
            assert self.cache.kv_pool.num_free >= num_kv and self.cache.state_pool.num_free >= num_states

    @rule(tokens=TOKENS)
    def match(self, tokens):
        tree = self.cache.tree
        snapshot = [(id(n), n.tokens, n.last_access, n.lock_ref, n.state_slot) for n in tree.nodes()]
        m = self.cache.match(tokens)
        assert [(id(n), n.tokens, n.last_access, n.lock_ref, n.state_slot) for n in tree.nodes()] == snapshot
        assert m.resume_len <= min(m.kv_len, len(tokens) - 1)
        assert m.resume_len == (_deepest_state(tree, tokens) if self.cache.config.prefix_cache else 0)
        assert (m.state_node is None) == (m.resume_len == 0)
        in_tree = set(tree.owned_kv().tolist())
        assert m.kv_indices.numel() == m.kv_len and set(m.kv_indices.tolist()) <= in_tree

    @precondition(lambda self: any(True for _ in self.cache.tree.nodes()))
    @rule(data=st.data())
    def lock(self, data):
        node = data.draw(st.sampled_from(list(self.cache.tree.nodes())))
        self.cache.tree.lock(node)
        self.external_locks.append((node, node.depth, node.tokens, node.kv.clone()))

    @precondition(lambda self: self.external_locks)
    @rule(data=st.data())
    def unlock(self, data):
        node = self.external_locks.pop(data.draw(st.integers(0, len(self.external_locks) - 1)))[0]
        self.cache.tree.unlock(node)

    # ---- after every step ------------------------------------------------------------------
    @invariant()
    def ownership_and_locks(self):
        self.cache.audit(external_locks=[lock[0] for lock in self.external_locks])
        for node, depth, tokens, kv in self.external_locks:
            # KV of a locked node is never evicted (a split may move its head into a new parent:
            # what it held then is still its edge's tail plus the ancestors' edges).
            assert _attached(self.cache.tree, node) and node.depth == depth
            assert tokens[len(tokens) - len(node.tokens):] == node.tokens
            assert torch.equal(kv[kv.numel() - node.kv.numel():], node.kv)
        for seq in self.cache.running:
            assert seq.locked_node is None or _attached(self.cache.tree, seq.locked_node)
            assert len(seq.state_slots()) <= 3  # working + at most two snapshots not yet donated
        assert all(node.state_pins == 0 for node in self.cache.tree.nodes())


CacheMachine.TestCase.settings = settings(max_examples=1000, stateful_step_count=20, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_cache_machine = CacheMachine.TestCase
