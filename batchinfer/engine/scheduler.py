"""Continuous batching: admission in plan order, chunked prefill, decode, preemption.

Each step runs at most one prefill forward (chunks of several sequences, ≤ max_batch_tokens
new tokens) and one decode forward (every running sequence with exactly one token to feed).
A prefill chunk ends at the sequence's next boundary: a planned branch point it leads, a
multiple of track_interval inside the prompt, or the end of its tokens — so the GDN state at
every such position exists at a chunk end and can be tracked.

Admission follows the plan's DFS order. A sequence planned to resume from a branch state
waits until its leader has computed past that point (the state is then in the tree), so the
reuse it gets equals the plan's regardless of max_running. A branch state stays in the tree
until its followers are admitted (the cache evicts it last, `expect_followers`), and a leader
is admitted only while the branch states it will open fit the state pool's cached share
beside those still waiting for followers — so only a pool too small for the plan's open
branches, or KV eviction under memory pressure, can make reuse less than planned. When a decode token finds no KV slot even after eviction, the
youngest running sequence is preempted: all its slots are freed, and it is re-admitted later
to recompute prompt + generated tokens (resuming from whatever the cache still holds).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

from batchinfer.engine.sequence import Sequence
from batchinfer.engine.stats import StatsTally
from cache.seq_handle import AWAITED_TOKEN

_ADMISSION_SCAN_FACTOR = 4  # waiting entries inspected per free running place, per step


@dataclass
class StepPlan:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    decode: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # cannot run even alone: finish with an error

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, cache, *, max_running: int, max_batch_tokens: int, track_interval: int,
                 wait_for_leaders: bool, tally: StatsTally, branch_state_capacity: int = 1 << 30,
                 max_model_len: int = 1 << 62, drain: Callable[[], None] = lambda: None) -> None:
        self.cache = cache                    # cache.StateCache
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.track_interval = track_interval
        self.wait_for_leaders = wait_for_leaders  # only when planned states are tracked (extra_buffer)
        self.tally = tally
        # Cached state slots beside the running requests' own: how many branch states may wait
        # for their followers at once (plan_pools' cache_state_slots).
        self.branch_state_capacity = branch_state_capacity
        self.max_model_len = max_model_len
        # Resolves every decode step still in flight (the engine's): called before preempting.
        self.drain = drain
        # (leader, depth) of branch states with followers still to come (sequences hash by identity).
        self._open_branches: set[tuple[Sequence, int]] = set()
        self.waiting: list[Sequence] = []     # sorted by priority
        self.running: list[Sequence] = []     # in admission order (youngest last)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.leader is not None:
                seq.leader.followers.setdefault(seq.planned_reuse, []).append(seq)
            bisect.insort(self.waiting, seq, key=lambda s: s.priority)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._admit(plan)
        self._reserve_decode_slots(plan)
        budget = self.max_batch_tokens
        for seq in self.running:
            if seq.pending < 2 or budget == 0:
                continue
            chunk = min(seq.pending, self.next_boundary(seq) - seq.computed, budget)
            plan.prefill.append((seq, chunk))
            budget -= chunk
        return plan

    def next_boundary(self, seq: Sequence) -> int:
        """First position after `computed` where a prefill chunk must end."""
        end = len(seq.tokens)
        later = [p for p in seq.checkpoints if p > seq.computed]
        if later:
            end = min(end, min(later))
        if seq.computed < seq.prompt_len:
            interval_mark = (seq.computed // self.track_interval + 1) * self.track_interval
            if interval_mark <= seq.prompt_len:
                end = min(end, interval_mark)
        return end

    def should_track(self, seq: Sequence) -> bool:
        """Whether the state at `seq.computed` (just reached) is a planned or interval checkpoint."""
        p = seq.computed
        return 0 < p <= seq.prompt_len and (p in seq.checkpoints or p % self.track_interval == 0)

    # ---- admission -------------------------------------------------------------------------
    def _admit(self, plan: StepPlan) -> None:
        free_places = self.max_running - len(self.running)
        scanned, limit = 0, max(1, free_places) * _ADMISSION_SCAN_FACTOR
        i = 0
        while i < len(self.waiting) and free_places > 0 and scanned < limit:
            seq = self.waiting[i]
            scanned += 1
            if self.wait_for_leaders and (not seq.is_ready() or not self._branches_fit(seq)):
                i += 1
                continue
            first = seq.cached_tokens is None
            handle = self.cache.admit(id(seq), seq.tokens,
                                      planned_resume=seq.planned_reuse if first and seq.leader is not None else 0)
            if handle is None:
                if not self.running:  # nothing will ever free room for it
                    self.waiting.pop(i)
                    plan.failed.append(seq)
                    seq.error = f"the cache cannot hold this sequence ({len(seq.tokens)} tokens) even alone"
                    continue
                break  # keep plan order: wait for running sequences to free room
            self.waiting.pop(i)
            self._start(seq, handle)
            if first:
                self._note_first_admission(seq)
            free_places -= 1

    def _branches_fit(self, seq: Sequence) -> bool:
        """A top-level leader's first admission opens a branch state per checkpoint; admit it only
        while they fit beside the open ones. Never held back: followers (nested leaders too —
        their admissions close branches), and anyone when nothing runs or nothing is open
        (waiting could not change the open set then)."""
        if seq.leader is not None or seq.cached_tokens is not None or not seq.followers \
                or not self._open_branches or not self.running:
            return True
        if len(self._open_branches) + len(seq.followers) <= self.branch_state_capacity:
            return True
        # About to hold a leader back: first drop branches whose remaining followers will never
        # be admitted (finished with an error before admission), so they cannot block for good.
        self._open_branches = {(leader, depth) for leader, depth in self._open_branches
                               if leader.followers_to_come(depth) > 0}
        return not self._open_branches or \
            len(self._open_branches) + len(seq.followers) <= self.branch_state_capacity

    def _note_first_admission(self, seq: Sequence) -> None:
        for depth in seq.followers:
            self._open_branches.add((seq, depth))
        leader = seq.leader
        if leader is not None and leader.followers_to_come(seq.planned_reuse) == 0:
            self._open_branches.discard((leader, seq.planned_reuse))

    def _start(self, seq: Sequence, handle) -> None:
        seq.handle = handle
        seq.computed = handle.resume_len
        seq.ring_cursor = 0  # admission copies or zeroes the working state: cursor 0
        if seq.cached_tokens is None:
            seq.cached_tokens = handle.resume_len
        else:
            self.tally.add(recomputed_tokens=len(seq.tokens) - handle.resume_len)
        seq.high_water = max(seq.high_water, seq.computed)
        # KV matched past the resume point, for want of a state there. The last token is always
        # recomputed (it yields the logits), so a KV hit on it is not counted as discarded.
        usable_kv = min(handle.matched_kv_len, len(seq.tokens) - 1)
        self.tally.add(discarded_kv_tokens=max(0, usable_kv - handle.resume_len))
        self.running.append(seq)

    # ---- decode slots and preemption -------------------------------------------------------
    def _reserve_decode_slots(self, plan: StepPlan) -> None:
        """KV slots for every decode token; preempt the youngest sequences when there are none.

        Usually every token fits: one allocation for the whole batch (`append_many`). Only when
        it does not are the sequences served one by one, preempting as they go — after the
        steps in flight are drained (`drain`), since a preempted sequence must know its tokens."""
        decoding = [seq for seq in self.running if seq.handle is not None and seq.pending == 1
                    and not seq.awaits_last_token(self.max_model_len)]
        # The token fed now sits at index `computed`; the handle lacks its KV slot unless it is a
        # prompt token (allocated at admission). A token still on the device goes in as
        # AWAITED_TOKEN until the engine resolves it (StateCache.resolve_token).
        needing = [seq for seq in decoding if seq.handle.num_tokens == seq.computed]
        ids = [seq.tokens[seq.computed] if seq.computed < len(seq.tokens) else AWAITED_TOKEN for seq in needing]
        if self.cache.append_many([seq.handle for seq in needing], ids):
            plan.decode.extend(decoding)
            return
        if any(seq.awaiting for seq in self.running):
            self.drain()
        self._reserve_one_by_one(plan)

    def _reserve_one_by_one(self, plan: StepPlan) -> None:
        for seq in list(self.running):
            if seq.pending != 1 or seq.handle is None:
                continue
            missing = seq.tokens[seq.handle.num_tokens:]  # the last sampled token, not yet fed
            while missing and self.cache.append(seq.handle, missing) is None:
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    self._drop(seq)
                    plan.failed.append(seq)
                    seq.error = f"the KV cache cannot hold this sequence ({len(seq.tokens)} tokens) even alone"
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                plan.decode.append(seq)
        plan.decode = [s for s in plan.decode if s.handle is not None]

    def preempt(self, seq: Sequence) -> None:
        self._drop(seq)
        seq.computed = 0
        bisect.insort(self.waiting, seq, key=lambda s: s.priority)
        self.tally.add(preemptions=1)

    def _drop(self, seq: Sequence) -> None:
        self.cache.abort(seq.handle)
        seq.handle = None
        self.running.remove(seq)

    # ---- completion ------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        self.cache.finish(seq.handle, seq.computed)
        seq.handle = None
        self.running.remove(seq)

    def abandon(self) -> None:
        """Drop every queued and running sequence (their slots go back; the tree stays)."""
        for seq in list(self.running):
            self._drop(seq)
        self.waiting.clear()
        self._open_branches.clear()
