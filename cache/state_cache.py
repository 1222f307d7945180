"""The state cache the engine drives: prefix matching, per-request slots, tracking and
donation of GDN states (extra_buffer / no_buffer), finish-time insertion, eviction."""
from __future__ import annotations

from dataclasses import asdict
from typing import Hashable, Optional, Sequence

import torch

from .audit import audit_state_cache
from .cache_config import CacheConfig, CacheStats
from .kv_pool import KVPool
from .radix_node import MatchResult, RadixNode
from .radix_tree import RadixTree
from .seq_handle import SeqHandle
from .state_pool import GdnStatePool

_MAX_UNDONATED = 2  # tracked snapshots a sequence may hold before the oldest is donated for it
# When KV must be evicted, free at least this share of the KV pool, so that a long job under
# memory pressure evicts in batches rather than at nearly every admission and decode step
# (docs/BENCHMARKS.md, "Cache: eviction that does not walk the tree"). 1/64 of the pool is a few
# dozen admissions' worth; it costs the least recently used ~1.6% of cached KV a little early.
_KV_EVICTION_SLACK = 1 / 64
_NO_MATCH = MatchResult(kv_len=0, kv_indices=torch.empty(0, dtype=torch.int64), state_node=None,
                        state_slot=None, resume_len=0)


class StateCache:
    """Owns the radix tree and hands out pool slots to requests; the engine's only cache API.

    Lifecycle of a request (call everything between model steps, never during one):
    1. `admit(key, tokens)` → `SeqHandle` or None (no room even after evicting). `tokens` is
       the sequence's own token list: the handle keeps a reference to it, the caller alone
       appends to it. The handle's working slot holds the state after `resume_len` tokens
       (copied from the cache, or zero); KV slots exist for every token in the list now;
       compute tokens[resume_len:].
    2. Before each step that feeds new tokens beyond those (decode), `append(seq, n)` allocates
       the KV slots of the next `n` tokens (returned; None when there is no room — preempt
       someone). Only append tokens that will be fed to the model. Their ids are not needed
       yet (a token may be fed while still on the device); the cache reads token ids from the
       list only where it inserts into the tree, so every token below a position it inserts —
       a donated snapshot's, `finish`'s `computed_len` — must be in the list by then.
    3. extra_buffer: after a step that leaves the working state at exactly `position` tokens,
       `track(seq, position)` snapshots it into a slot taken from the pool right then (evicting
       a cached state if needed; skipped if none can be had); `donate(seq)` hands the tracked
       states to the tree (the engine donates at once; a later donation is allowed, with at
       most two snapshots held per sequence). no_buffer: both no-ops.
    4. `finish(seq)` when done: inserts the computed tokens' KV (and, by strategy, states) into the
       tree, unlocks, frees the rest. `abort(seq)` (error, preemption): frees everything the
       request owns, leaves the tree as it is.
    `ensure_free` / `can_admit` evict least-recently-used cache contents to make room: KV of
    nodes no running sequence holds, and states of any node (running sequences never read the
    tree's states after admission) except the one an admission is copying.
    Ownership: every KV slot and state slot is owned by exactly one of: a request, the tree, the
    free list; `audit()` checks it.
    ReplaySSM cursor (pending ring entries of a slot; part of its state): on the device (the
    pool's `cursor`, which the kernels read) the cache sets it to 0 wherever it copies or hands
    over a state (admission, `track`, donation, no_buffer `finish`: `GdnStatePool.copy` /
    `flush` / `reset_cursor`), and the model advances a decode step's slots after all layers
    (`n ← n % L + 1`, a full ring folded first; it also folds pending entries before a prefill,
    which the engine never leaves: a sequence prefills only before it decodes). On the host,
    `SeqHandle.ring_cursor` mirrors the working slot's: 0 at admission, moved by `ring_steps`
    once per decode step.
    """

    def __init__(self, kv_pool: KVPool, state_pool: GdnStatePool, config: CacheConfig = CacheConfig()) -> None:
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.config = config
        self.tree = RadixTree()
        self._counts = dict(asdict(CacheStats()))
        self._live: dict[int, SeqHandle] = {}

    # ---- queries ---------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> MatchResult:
        """What admission would reuse (no side effects)."""
        return self.tree.match(tokens) if self.config.prefix_cache else _NO_MATCH

    def stats(self) -> CacheStats:
        return CacheStats(**self._counts)

    @property
    def running(self) -> list[SeqHandle]:
        return list(self._live.values())

    # ---- room ------------------------------------------------------------------------------
    def ensure_free(self, num_kv: int, num_states: int = 0, spare_expected: bool = False) -> bool:
        """Evict until the pools have `num_kv` KV slots and `num_states` state slots free.

        Returns False — evicting nothing — when that is impossible even after evicting all the
        evictable cache content (unlocked KV, unpinned states; with `spare_expected`, not the
        states planned followers will resume from).
        """
        short_kv = max(0, num_kv - self.kv_pool.num_free)
        short_states = max(0, num_states - self.state_pool.num_free)
        if not short_kv and not short_states:
            return True
        evictable_kv, evictable_states = self.tree.evictable(spare_expected)
        if short_kv > evictable_kv or short_states > evictable_states:
            return False
        if short_kv:
            short_kv = min(evictable_kv, max(short_kv, int(self.kv_pool.num_slots * _KV_EVICTION_SLACK)))
        self.evict(short_kv, short_states, spare_expected)
        return self.kv_pool.num_free >= num_kv and self.state_pool.num_free >= num_states

    def evict(self, num_kv: int, num_states: int = 0, spare_expected: bool = False) -> tuple[int, int]:
        """Evict at least this much evictable cache content (LRU, see `RadixTree.evict`) back to
        the pools, whatever is free now; returns (KV tokens, states) actually freed."""
        evicted = self.tree.evict(num_kv, num_states, spare_expected)
        self.kv_pool.free(evicted.kv_indices)
        self.state_pool.free(evicted.state_slots)
        self._counts["kv_evicted_tokens"] += evicted.kv_indices.numel()
        self._counts["states_evicted"] += len(evicted.state_slots)
        return evicted.kv_indices.numel(), len(evicted.state_slots)

    def can_admit(self, tokens: Sequence[int]) -> bool:
        """Whether `admit(tokens)` would succeed now (it may evict to find out)."""
        match = self.match(tokens)
        self._hold(match.state_node)  # the reusable prefix must survive the eviction
        try:
            return self.ensure_free(len(tokens) - match.resume_len, num_states=1)  # its working slot
        finally:
            self._let_go(match.state_node)

    # ---- request lifecycle -----------------------------------------------------------------
    def admit(self, key: Hashable, tokens: Sequence[int], planned_resume: int = 0,
              max_resume: Optional[int] = None) -> Optional[SeqHandle]:
        """Match, lock the reused prefix, allocate slots, set the working state; None if no room.

        `planned_resume` > 0: this admission is one of the followers the plan expected to resume
        at that depth (`expect_followers`); once admitted it no longer holds that state back.
        `max_resume`: resume at most this deep (a scoring request computes its continuation's positions)."""
        if len(tokens) < 1:
            raise ValueError("a prompt needs at least one token")
        match = self.match(tokens if max_resume is None else tokens[:max_resume + 1])
        node, resume = match.state_node, match.resume_len
        self._hold(node)  # lock (KV for good) and pin the state until it is copied below
        if not self.ensure_free(len(tokens) - resume, num_states=1):  # its working slot
            self._let_go(node)
            return None
        working = self.state_pool.alloc()
        if node is not None:
            self.state_pool.copy(match.state_slot, working)  # folded, cursor 0; the tree's copy stays
            self.tree.unpin_state(node)  # copied: from now on the tree may evict it; the lock stays
        else:
            self.state_pool.zero_(working)
        new_kv = self.kv_pool.alloc(len(tokens) - resume)
        seq = SeqHandle(key, tokens, torch.cat([match.kv_indices[:resume], new_kv]), working,
                        node, resume_len=resume, matched_kv_len=match.kv_len)
        self._live[id(seq)] = seq
        self._counts["kv_matched_tokens"] += match.kv_len
        self._counts["reused_tokens"] += resume
        self._counts["discarded_kv_tokens"] += match.kv_len - resume
        if planned_resume > 0:
            planned = self.tree.node_at(tokens, planned_resume)
            if planned is not None:
                self.tree.follower_admitted(planned)
        self._note_peaks()
        return seq

    def append(self, seq: SeqHandle, num_tokens: int) -> Optional[torch.Tensor]:
        """KV slots for the next `num_tokens` tokens about to be fed (int64 CPU, one per token),
        or None if no room."""
        if not self.ensure_free(num_tokens):
            return None
        kv = self.kv_pool.alloc(num_tokens)
        seq._extend(kv)
        self._note_peaks()
        return kv

    def append_many(self, seqs: Sequence[SeqHandle]) -> bool:
        """The KV slot of one more token for each sequence (a decode step), in one allocation,
        evicting once if needed. All or nothing: False (nothing taken) when there is no room for
        every token even after eviction — fall back to `append` per sequence to decide whom to
        preempt. Same slots, in the same order, as `append(seq, 1)` one by one."""
        if not seqs:
            return True
        if not self.ensure_free(len(seqs)):
            return False
        kv = self.kv_pool.alloc(len(seqs)).tolist()  # one free-list pop for the whole batch
        for seq, slot in zip(seqs, kv):
            seq._append_one(slot)
        self._note_peaks()
        return True

    def ring_steps(self, seqs: Sequence[SeqHandle]) -> int:
        """One ReplaySSM decode step ran on these sequences' working slots (the model advanced
        their device cursors): advance the host mirrors the same way; returns how many found a
        full ring (cursor == L), which the step folded into the state snapshot. 0 without ReplaySSM."""
        ring_len = self.state_pool.shape.ring_len
        if not ring_len:
            return 0
        folds = 0
        for seq in seqs:
            folds += seq.ring_cursor == ring_len
            seq.ring_cursor = seq.ring_cursor % ring_len + 1
        return folds

    def track(self, seq: SeqHandle, position: int) -> bool:
        """Snapshot the working state, which must be at exactly `position` tokens, into a state
        slot allocated now (evicting the least recently used cached state if the pool is empty).

        The snapshot is folded with cursor 0 (`GdnStatePool.copy`); the working slot is
        untouched — its ring stays consistent with its own snapshot, so its cursor must not be
        reset. If the sequence already holds two undonated snapshots, the older one is donated
        first (its tokens must be in the sequence's list by then, as for `donate`). Returns False
        (nothing done) under no_buffer / without prefix caching, when `position` is not past the
        part of the sequence already in the tree, or when no state slot can be had even after
        eviction (counted as `tracks_skipped`: the state is simply not cached, and later
        sequences that would have resumed there recompute).
        """
        self._check_live(seq)
        if not self.config.tracks or not seq.tree_len < position <= seq.num_tokens:
            return False
        if len(seq.filled_tracks) >= _MAX_UNDONATED:
            self._check_known(seq, seq.filled_tracks[0][0])
            self._donate_one(seq, *seq.filled_tracks.pop(0))
        slot = self._alloc_state(spare_expected=True)
        if slot is None:
            self._counts["tracks_skipped"] += 1
            return False
        self.state_pool.copy(seq.working_slot, slot)
        seq.filled_tracks.append((position, slot))
        self._counts["states_tracked"] += 1
        return True

    def donate(self, seq: SeqHandle) -> int:
        """Give every tracked state to the tree node ending at its position; returns how many.

        The tree takes the KV of tokens[:position] too (keyed by those ids: they must be in the
        sequence's list); the sequence's kv_indices switch to the tree's slots there (duplicates
        are freed) and its lock moves down to that node. A snapshot the tree does not take (the
        node already has a state) goes back to the pool.
        """
        self._check_live(seq)
        if seq.filled_tracks:
            self._check_known(seq, max(p for p, _ in seq.filled_tracks))
        donated = 0
        while seq.filled_tracks:
            donated += self._donate_one(seq, *seq.filled_tracks.pop(0))
        return donated

    def expect_followers(self, seq: SeqHandle, position: int, count: int) -> bool:
        """`count` planned admissions will resume from the state at `position` of `seq`'s tokens
        (donated by `seq`, or already in the tree): eviction keeps it until they are admitted
        (`admit(..., planned_resume=position)`) unless nothing else is left to evict. Returns
        False (nothing done) when the tree holds no state there."""
        self._check_live(seq)
        if count <= 0:
            return False
        node = self.tree.node_at(seq.tokens, position)
        if node is None or node.state_slot is None:
            return False
        self.tree.expect_followers(node, count)
        return True

    def forget_followers(self, tokens: Sequence[int], position: int, count: int) -> None:
        """`count` of the planned admissions expected to resume from the state at `position` of
        `tokens` will not come (failed, or the run was abandoned); with none left to come it is
        evicted like any other state."""
        node = self.tree.node_at(tokens, position)
        if node is not None and node.state_slot is not None:
            self.tree.forget_followers(node, count)

    def finish(self, seq: SeqHandle, computed_len: Optional[int] = None) -> None:
        """The sequence is done: cache what the strategy keeps, free the rest, forget the handle.

        `computed_len` (default: every token with a KV slot) is how many tokens the model has
        consumed, all of them in the sequence's list; KV slots of tokens past it are freed, not
        cached. extra_buffer: tracked states are donated, then the KV of all computed tokens is
        inserted (no state at the end). no_buffer: the working state is flushed (cursor 0) and
        inserted at depth computed_len with that KV.
        """
        self._check_live(seq)
        n = seq.num_tokens if computed_len is None else computed_len
        if not 0 <= n <= seq.num_tokens:
            raise ValueError(f"computed_len {n} outside 0..{seq.num_tokens}")
        self._check_known(seq, n)
        self.kv_pool.free(seq._truncate(max(n, seq.tree_len)))
        if not self.config.prefix_cache:
            self.abort(seq)
            return
        past_end = [slot for p, slot in seq.filled_tracks if p > n]  # snapshots of uncomputed tokens
        seq.filled_tracks = [(p, slot) for p, slot in seq.filled_tracks if p <= n]
        self.state_pool.free(past_end)
        self.donate(seq)
        keep_working = False
        if self.config.mode == "no_buffer" and n > 0:
            self.state_pool.flush(seq.working_slot)  # the tree must get a state with no pending entries
            keep_working = self._insert(seq, n, seq.working_slot)
        else:
            self._insert(seq, n, None)
        self._release(seq, free_working=not keep_working)

    def abort(self, seq: SeqHandle) -> None:
        """Free everything the sequence owns (KV past the tree part, all its state slots); unlock.
        The tree is left as it is. Use for errors and preemption (re-admit later to resume)."""
        self._check_live(seq)
        self.kv_pool.free(seq.owned_kv.clone())
        self._release(seq, free_working=True)


    # ---- internals -------------------------------------------------------------------------
    def _hold(self, node: Optional[RadixNode]) -> None:
        """Lock `node` (its path's KV) and pin its state: it is about to be copied."""
        if node is not None:
            self.tree.lock(node)
            self.tree.pin_state(node)

    def _let_go(self, node: Optional[RadixNode]) -> None:
        if node is not None:
            self.tree.unpin_state(node)
            self.tree.unlock(node)

    def _donate_one(self, seq: SeqHandle, position: int, slot: int) -> int:
        self.state_pool.reset_cursor([slot])  # copy left it at 0 already; cheap insurance
        taken = self._insert(seq, position, slot)
        if not taken:
            self.state_pool.free(slot)  # the tree had a state there already
        return int(taken)

    def _insert(self, seq: SeqHandle, length: int, state_slot: Optional[int]) -> bool:
        """Insert tokens[:length] (+ state at the end); adopt the tree's KV; move the lock down.
        Returns whether the tree took `state_slot`."""
        result = self.tree.insert(seq.tokens[:length], seq.kv_indices[:length], state_slot)
        self.kv_pool.free(result.dup_kv)
        seq._adopt_prefix(result.kv_indices)
        if length > seq.tree_len:
            self.tree.lock(result.node)  # before unlocking the old one: the shared path stays pinned
            if seq.locked_node is not None:
                self.tree.unlock(seq.locked_node)
            seq.locked_node, seq.tree_len = result.node, length
        taken = state_slot is not None and result.unused_state is None
        self._counts["states_donated"] += taken
        return taken

    def _alloc_state(self, spare_expected: bool = False) -> Optional[int]:
        if not self.ensure_free(0, 1, spare_expected):
            return None
        slot = self.state_pool.alloc()
        self._note_peaks()
        return slot

    def _release(self, seq: SeqHandle, free_working: bool) -> None:
        slots = [s for _, s in seq.filled_tracks]
        if free_working:
            slots.append(seq.working_slot)
        self.state_pool.free(slots)
        if seq.locked_node is not None:
            self.tree.unlock(seq.locked_node)
        seq.locked_node, seq.filled_tracks = None, []
        del self._live[id(seq)]

    @staticmethod
    def _check_known(seq: SeqHandle, length: int) -> None:
        """The tree keys cached KV by token id: inserting tokens[:length] needs each id known."""
        if length > len(seq.tokens):
            raise ValueError(f"sequence {seq.key!r}: {length} tokens to cache, but only "
                             f"{len(seq.tokens)} are known (the rest are still on the device)")

    def _check_live(self, seq: SeqHandle) -> None:
        if id(seq) not in self._live:
            raise RuntimeError(f"sequence {seq.key!r} is not running in this cache (finished or aborted)")

    def _note_peaks(self) -> None:
        self._counts["peak_kv_used"] = max(self._counts["peak_kv_used"], self.kv_pool.num_used)
        self._counts["peak_states_used"] = max(self._counts["peak_states_used"], self.state_pool.num_used)

    # ---- invariants ------------------------------------------------------------------------
    def audit(self, external_locks: Sequence[RadixNode] = ()) -> None:
        """Every KV and state slot has exactly one owner (request, tree, free list); the tree's lock
        counts equal the running sequences' locks plus `external_locks` (nodes locked directly).
        Raises AssertionError otherwise. O(pool size + tree size): for tests and debugging."""
        audit_state_cache(self, external_locks)
