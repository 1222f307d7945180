"""Radix tree over token ids: which prefixes have KV cached, and where a GDN state exists.

Pure bookkeeping on the CPU: the tree never touches pool tensors and never frees anything
itself. What it takes it owns (KV indices of its edges, state slots at node ends); what it
gives up (`insert`'s duplicates, `evict`'s victims) it returns for the caller to free.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterator, Optional, Sequence

import torch

from .radix_node import EMPTY_KV, Evicted, InsertResult, MatchResult, RadixNode


def _common_prefix_len(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    if edge[:n] == tokens[start:start + n]:  # the common case, compared in C
        return n
    i = 0
    while edge[i] == tokens[start + i]:
        i += 1
    return i


class RadixTree:
    """Prefix tree with token-granular edges, LRU eviction, and per-node GDN states.

    Contract:
    - `match` never mutates (not even LRU times); `lock` marks use.
    - `insert` takes ownership of the caller's KV slots for tokens it did not hold and of the
      state slot if it sets it; splits edges as needed (a split-off upper node has no state).
    - `lock(node)`/`unlock(node)` ref-count the node and all its ancestors. The KV of a locked
      node is never evicted (running sequences read it every step); its *state* may be: a
      sequence copied the state it resumed from into its working slot at admission and never
      reads the tree's states again. Splits keep the counts right: a lock taken on a node stays
      valid for that node object (splits create the *upper* part as the new node).
    - `pin_state(node)`/`unpin_state(node)` protect one node's state while an admission copies
      it (the only moment a state in the tree is read); a pinned state is never evicted.
    - `expect_followers(node, n)` / `follower_admitted(node)`: the planner's promise that n
      more admissions will resume from this node's state (a branch state whose followers wait
      for room); `forget_followers(node, n)` withdraws n of them. Such a state is evicted
      last, and never when the caller asks to spare it (`spare_expected`: a tracked interval
      state is worth less than a planned branch state).
    - `evict` frees least-recently-used material: states first if asked (any node whose state
      is not pinned, inner and locked ones included — states without expected followers first,
      then unlocked ones; a state may go before its KV), then KV from unlocked leaves — leaves
      without a state first (their KV lies past the last state on the path, useless for
      resuming), trimmed from the tail when only part is needed; a leaf with a state goes
      whole, state included; leaves whose state has expected followers go last. Leaves wait in
      a heap kept between calls, so an eviction costs O(log n) per victim, not a walk of the tree.
    """

    # The leaf heap is rebuilt once it holds more than factor × leaves + floor entries.
    heap_rebuild_factor = 4
    heap_rebuild_floor = 64

    def __init__(self) -> None:
        self.root = RadixNode(tokens=(), kv=EMPTY_KV, parent=None, depth=0)
        self._clock = 0
        self.num_kv_tokens = 0   # KV slots owned by the tree
        self.num_states = 0      # state slots owned by the tree
        # Held by locked nodes / pinned states: kept incrementally so that "how much could
        # eviction free" is O(1) — the engine asks at every admission under memory pressure.
        self._locked_kv_tokens = 0
        self._pinned_states = 0
        self._spared_states = 0  # states pinned or with expected followers
        # The nodes holding a state, by id: state eviction looks only at these (a few dozen)
        # instead of walking every node (thousands on a big job, at every tracked chunk).
        self._state_nodes: dict[int, RadixNode] = {}
        # The leaves (root excluded), by id, and a lazy min-heap of the unlocked ones by eviction
        # key: KV eviction pops from it instead of walking every node (tens of thousands on a
        # big job). A node's entry is valid while its `heap_version` matches; every change to a
        # leaf's key or eligibility pushes a fresh entry (`_offer`), stale ones are skipped.
        self._leaves: dict[int, RadixNode] = {}
        self._leaf_heap: list[tuple] = []
        self._tie = itertools.count()  # heap entries never compare nodes

    # ---- lookup ----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> MatchResult:
        tokens = tuple(tokens)
        node, depth, pieces = self.root, 0, []
        state_node: Optional[RadixNode] = None
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            n = _common_prefix_len(child.tokens, tokens, depth)
            pieces.append(child.kv[:n])
            depth += n
            if n < len(child.tokens):
                break  # partial edge: its KV counts, its end state does not
            node = child
            if node.state_slot is not None and node.depth <= len(tokens) - 1:
                state_node = node
        kv = torch.cat(pieces) if pieces else EMPTY_KV
        return MatchResult(kv_len=depth, kv_indices=kv, state_node=state_node,
                           state_slot=None if state_node is None else state_node.state_slot,
                           resume_len=0 if state_node is None else state_node.depth)

    def node_at(self, tokens: Sequence[int], depth: int) -> Optional[RadixNode]:
        """The node ending exactly `depth` tokens down the path of `tokens` (None: no such node)."""
        if not 0 < depth <= len(tokens):
            return None
        tokens = tuple(tokens[:depth])
        node, at = self.root, 0
        while at < depth:
            child = node.children.get(tokens[at])
            if child is None or child.depth > depth or child.tokens != tokens[at:child.depth]:
                return None
            node, at = child, child.depth
        return node

    # ---- insertion -------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], kv_indices: torch.Tensor,
               state_slot_at_end: Optional[int] = None) -> InsertResult:
        tokens = tuple(tokens)
        kv_indices = torch.as_tensor(kv_indices, dtype=torch.int64).reshape(-1).cpu()
        if kv_indices.numel() != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {kv_indices.numel()} KV slots")
        self._clock += 1
        node, depth = self.root, 0
        path_kv, dups = [], []
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                child = RadixNode(tokens=tokens[depth:], kv=kv_indices[depth:].clone(), parent=node,
                                  depth=len(tokens))
                node.children[tokens[depth]] = child
                self._leaves.pop(id(node), None)  # no longer a leaf (the root never is in the index)
                self._leaves[id(child)] = child
                self._offer(child)
                self.num_kv_tokens += len(child.tokens)
                path_kv.append(child.kv)
            else:
                n = _common_prefix_len(child.tokens, tokens, depth)
                if n < len(child.tokens):
                    child = self._split(child, n)
                mine = kv_indices[depth:depth + n]
                dups.append(mine[mine != child.kv])  # equal slots were the tree's already (borrowed)
                path_kv.append(child.kv)
            child.last_access = self._clock
            node, depth = child, child.depth
        unused = state_slot_at_end
        if state_slot_at_end is not None and node is not self.root and node.state_slot is None:
            node.state_slot, unused = state_slot_at_end, None
            self._state_nodes[id(node)] = node
            self.num_states += 1
        self._offer(node)  # a newer last access, maybe a state: a new key if it is a leaf
        return InsertResult(node=node, kv_indices=torch.cat(path_kv) if path_kv else EMPTY_KV,
                            dup_kv=torch.cat(dups) if dups else EMPTY_KV, unused_state=unused)

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node`'s edge after n tokens; returns the new upper node (no state of its own)."""
        parent = node.parent
        upper = RadixNode(tokens=node.tokens[:n], kv=node.kv[:n].clone(), parent=parent,
                          depth=node.depth - len(node.tokens) + n, lock_ref=node.lock_ref,
                          last_access=node.last_access)
        parent.children[upper.tokens[0]] = upper
        node.tokens, node.kv, node.parent = node.tokens[n:], node.kv[n:].clone(), upper
        upper.children[node.tokens[0]] = node
        return upper

    # ---- locking ---------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        self._clock += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._locked_kv_tokens += len(node.tokens)
            node.lock_ref += 1
            node.last_access = self._clock
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_kv_tokens -= len(node.tokens)
                self._offer(node)  # an unlocked leaf is evictable again
            node = node.parent

    def pin_state(self, node: RadixNode) -> None:
        """Keep `node`'s state from eviction until `unpin_state` (an admission copies it).
        The caller holds a lock on the node (its KV must stay too), from before pinning until
        after unpinning."""
        if node.state_slot is None or node.lock_ref == 0:
            raise RuntimeError("pin_state needs a locked node with a state")
        spared = self._is_spared(node)
        node.state_pins += 1
        self._pinned_states += node.state_pins == 1
        self._spared_states += not spared

    def unpin_state(self, node: RadixNode) -> None:
        if node.state_pins <= 0:
            raise RuntimeError("unpin_state of a state that is not pinned")
        node.state_pins -= 1
        self._pinned_states -= node.state_pins == 0
        self._spared_states -= not self._is_spared(node)

    def expect_followers(self, node: RadixNode, count: int) -> None:
        """`count` more planned admissions will resume from `node`'s state (see the contract)."""
        if node.state_slot is None or count < 0:
            raise RuntimeError("expect_followers needs a node with a state and a count >= 0")
        spared = self._is_spared(node)
        node.followers += count
        self._spared_states += self._is_spared(node) and not spared
        self._offer(node)

    def follower_admitted(self, node: RadixNode) -> None:
        """One planned admission from `node` happened (a no-op when none is expected any more:
        the state may have been evicted, which clears the count)."""
        if node.followers > 0:
            node.followers -= 1
            self._spared_states -= not self._is_spared(node)
            self._offer(node)

    def forget_followers(self, node: RadixNode, count: int) -> None:
        """`count` of the planned admissions expected from `node`'s state will not come (at most
        as many as are still expected are forgotten)."""
        if node.followers > 0 and count > 0:
            node.followers = max(0, node.followers - count)
            self._spared_states -= not self._is_spared(node)
            self._offer(node)

    @staticmethod
    def _is_spared(node: RadixNode) -> bool:
        return node.state_slot is not None and (node.state_pins > 0 or node.followers > 0)

    def _drop_state(self, node: RadixNode) -> int:
        """Take `node`'s (unpinned) state away from it; returns the slot."""
        self._spared_states -= self._is_spared(node)
        slot, node.state_slot, node.followers = node.state_slot, None, 0
        del self._state_nodes[id(node)]
        self._offer(node)
        return slot

    def _offer(self, node: RadixNode) -> None:
        """Invalidate `node`'s heap entries; push a fresh one if it is an unlocked leaf."""
        node.heap_version += 1
        if node.lock_ref == 0 and id(node) in self._leaves:
            heapq.heappush(self._leaf_heap, self._leaf_key(node))
            if len(self._leaf_heap) > self.heap_rebuild_factor * len(self._leaves) + self.heap_rebuild_floor:
                # Mostly stale entries: one fresh entry per unlocked leaf.
                self._leaf_heap = [self._leaf_key(n) for n in self._leaves.values() if n.lock_ref == 0]
                heapq.heapify(self._leaf_heap)

    def _leaf_key(self, node: RadixNode) -> tuple:
        return (node.followers > 0, node.state_slot is not None, node.last_access, next(self._tie),
                node.heap_version, node)

    def _valid_entry(self, entry: tuple) -> bool:
        node = entry[-1]
        return entry[-2] == node.heap_version and node.lock_ref == 0 and id(node) in self._leaves

    # ---- eviction --------------------------------------------------------------------------
    def evictable(self, spare_expected: bool = False) -> tuple[int, int]:
        """(KV tokens, states) that `evict` could free right now: KV not locked, states not pinned
        (nor expecting followers, with `spare_expected`)."""
        held = self._spared_states if spare_expected else self._pinned_states
        return self.num_kv_tokens - self._locked_kv_tokens, self.num_states - held

    def evict(self, num_kv_tokens: int, num_states: int = 0, spare_expected: bool = False) -> Evicted:
        """Free at least the asked amounts where possible (fewer if too much is locked / pinned).
        `spare_expected` keeps states with expected followers out of the state eviction."""
        freed_kv: list[torch.Tensor] = []
        freed_states: list[int] = []
        if num_states > 0:
            # States nobody is planned to resume from first; then unlocked ones: a locked node
            # lies on a running sequence's path, so the next admissions in plan (DFS) order are
            # the likeliest to resume from it.
            candidates = (n for n in self._state_nodes.values() if n.state_pins == 0
                          and not (spare_expected and n.followers > 0))
            victims = heapq.nsmallest(num_states, candidates,
                                      key=lambda n: (n.followers > 0, n.lock_ref > 0, n.last_access))
            for node in victims:
                freed_states.append(self._drop_state(node))
        if num_kv_tokens > 0:
            freed_kv, leaf_states = self._evict_leaves(num_kv_tokens)
            freed_states += leaf_states
        self.num_states -= len(freed_states)
        kv = torch.cat(freed_kv) if freed_kv else EMPTY_KV
        self.num_kv_tokens -= kv.numel()
        return Evicted(kv_indices=kv, state_slots=tuple(freed_states))

    def _evict_leaves(self, num_kv_tokens: int) -> tuple[list[torch.Tensor], list[int]]:
        freed_kv, freed_states, count = [], [], 0
        while count < num_kv_tokens and self._leaf_heap:
            entry = heapq.heappop(self._leaf_heap)
            if not self._valid_entry(entry):
                continue
            node = entry[-1]
            need = num_kv_tokens - count
            if node.state_slot is None and need < len(node.tokens):
                # Trim the tail only: the rest of the edge stays a valid (stateless) prefix.
                freed_kv.append(node.kv[-need:])
                node.tokens, node.kv, node.depth = node.tokens[:-need], node.kv[:-need].clone(), node.depth - need
                count += need
                self._offer(node)  # still an unlocked leaf, key unchanged: back in the heap
                break
            freed_kv.append(node.kv)
            if node.state_slot is not None:
                freed_states.append(self._drop_state(node))
            count += len(node.tokens)
            parent = node.parent
            del parent.children[node.tokens[0]]
            del self._leaves[id(node)]
            node.heap_version += 1  # gone from the tree: any entry left is stale
            if parent is not self.root and parent.is_leaf:
                self._leaves[id(parent)] = parent
                self._offer(parent)
        return freed_kv, freed_states

    # ---- inspection ------------------------------------------------------------------------
    def nodes(self) -> Iterator[RadixNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def owned_kv(self) -> torch.Tensor:
        pieces = [n.kv for n in self.nodes()]
        return torch.cat(pieces) if pieces else EMPTY_KV

    def owned_states(self) -> list[int]:
        return [n.state_slot for n in self._state_nodes.values()]

    def audit(self) -> None:
        """Structural invariants: edges, depths, children keys, lock counts, totals."""
        kv_total = states = locked_kv = pinned_states = spared_states = 0
        for node in self.nodes():
            assert len(node.tokens) >= 1 and node.kv.numel() == len(node.tokens), "edge/KV length mismatch"
            assert node.depth == node.parent.depth + len(node.tokens), "depth out of step with parent"
            assert node.parent.children.get(node.tokens[0]) is node, "child keyed by a wrong token"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock count below children"
            kv_total += len(node.tokens)
            states += node.state_slot is not None
            locked_kv += len(node.tokens) if node.lock_ref else 0
            assert node.state_pins == 0 or node.state_slot is not None, "a pin on a node without a state"
            pinned_states += node.state_pins > 0
            assert node.followers == 0 or node.state_slot is not None, "followers expected of a node without a state"
            spared_states += self._is_spared(node)
        assert self.root.lock_ref == 0 and self.root.state_slot is None
        assert kv_total == self.num_kv_tokens and states == self.num_states, "tree totals drifted"
        assert {id(n) for n in self.nodes() if n.state_slot is not None} == set(self._state_nodes), \
            "state index drifted"
        assert {id(n) for n in self.nodes() if n.is_leaf} == set(self._leaves), "leaf index drifted"
        # Exactly one valid heap entry per unlocked leaf, holding its current eviction key.
        valid = [e for e in self._leaf_heap if self._valid_entry(e)]
        assert sorted(id(e[-1]) for e in valid) == sorted(id(n) for n in self._leaves.values() if n.lock_ref == 0), \
            "leaf heap out of step with the unlocked leaves"
        assert all(e[:3] == (e[-1].followers > 0, e[-1].state_slot is not None, e[-1].last_access) for e in valid), \
            "a leaf heap entry holds a stale key"
        assert (locked_kv, pinned_states) == (self._locked_kv_tokens, self._pinned_states), "locked totals drifted"
        assert spared_states == self._spared_states, "spared-state total drifted"
