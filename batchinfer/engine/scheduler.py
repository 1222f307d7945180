"""Continuous batching: admission in plan order, chunked prefill, decode, preemption.

Each step decodes every running sequence with exactly one token to feed and prefills chunks
of several sequences, ≤ max_batch_tokens new tokens (with `decode_rows_in_budget`, the engine's
mixed step: one forward over both, whose decode rows count against that budget first, and whose
prompt tokens beside them a `step_cost.StepCost` model picks when given).
A prefill chunk ends at the sequence's next boundary: a planned branch point it leads, a
multiple of track_interval inside the prompt, or the end of its tokens — so the GDN state at
every such position exists at a chunk end and can be tracked.

Admission follows the plan's DFS order. A sequence planned to resume from a branch state
waits until its leader has computed past that point (the state is then in the tree); later
rows go in meanwhile. The state pool is the bound (extra_buffer): one working slot per
running sequence plus every *live* branch state — from its leader's first admission until
its last planned follower's — never exceeds the pool's slots. In DFS order the rows sharing
a prefix are a run of the sorted rows, so the live branch states are those whose run holds
an admitted row; admission checks the count before each row goes in (`_fits`), and the cache
evicts a live state only when nothing else is left (`expect_followers`), which the bound
rules out for the state pool. So reuse equals the plan whatever the pool size and
max_running. Pace: beyond the pool's cached share (`branch_state_capacity`) of live states,
only the head of the plan opens more, so followers keep finding working slots. A plan that
cannot fit — say one row leading more branch states than the pool holds beside one working slot
— is run anyway: when nothing runs and no waiting row fits, the head goes in with its deepest
branch states given up (`branch_states_over_capacity`; their followers recompute). KV
eviction under memory pressure can still take a live state (the KV goes first); both show in
`planned_reuse_lost_tokens`. When a decode token finds no KV slot even after eviction, the
youngest running sequence is preempted: all its slots are freed, and it is re-admitted later
to recompute prompt + generated tokens (resuming from whatever the cache still holds).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from batchinfer.engine.sequence import Sequence
from batchinfer.engine.stats import StatsTally
from batchinfer.engine.step_cost import StepCost
from batchinfer.engine.wait_queue import WaitQueue

_ADMISSION_SCAN_FACTOR = 4  # waiting entries inspected per free running place, per step


@dataclass
class StepPlan:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    decode: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # cannot run even alone: finish with an error
    # Decode tokens found no KV slots while tokens are still in flight: preempting needs every
    # token on the host, so `schedule` stopped; read them, then `schedule_rest` this plan.
    needs_host_tokens: bool = False


class Scheduler:
    def __init__(self, cache, *, max_running: int, max_batch_tokens: int, track_interval: int,
                 wait_for_leaders: bool, tally: StatsTally, state_slots: int = 1 << 30,
                 branch_state_capacity: int = 1 << 30,
                 max_model_len: int = 1 << 62, decode_rows_in_budget: bool = False,
                 step_cost: Optional[StepCost] = None) -> None:
        self.cache = cache                    # cache.StateCache
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        # Mixed steps: a decode row is a token of the step, so prefill gets what they leave.
        self.decode_rows_in_budget = decode_rows_in_budget
        # Mixed steps: the prompt tokens beside the decode rows come from this cost model (step_cost.py).
        self.step_cost = step_cost if decode_rows_in_budget else None
        self.track_interval = track_interval
        self.wait_for_leaders = wait_for_leaders  # only when planned states are tracked (extra_buffer)
        self.tally = tally
        # The whole state pool: working slots plus live branch states never exceed it.
        self.state_slots = state_slots
        # Cached state slots beside the running requests' own (plan_pools' cache_state_slots):
        # the pace of admission, how many branch states leaders other than the head may open.
        self.branch_state_capacity = branch_state_capacity
        self.max_model_len = max_model_len
        # Live branch states: (leader, depth) → planned followers not yet admitted (sequences
        # hash by identity). Counted from the leader's first admission, before the state exists.
        self._live_branches: dict[tuple[Sequence, int], int] = {}
        self.waiting = WaitQueue()            # in priority (plan) order
        self.running: list[Sequence] = []     # in admission order (youngest last)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.leader is not None:
                seq.leader.add_follower(seq)
        self.waiting.add(seqs)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """This step's work: admit waiting sequences, reserve decode KV slots, cut prefill chunks.
        Stops early with `plan.needs_host_tokens` (see there)."""
        plan = StepPlan()
        self._admit(plan)
        if self._reserve_decode_slots(plan):
            self._plan_prefill(plan)
        return plan

    def schedule_rest(self, plan: StepPlan) -> None:
        """Finish a plan that stopped for tokens in flight, once the host has them all."""
        plan.needs_host_tokens = False
        self._reserve_one_by_one(plan)
        self._plan_prefill(plan)

    def _plan_prefill(self, plan: StepPlan) -> None:
        budget = self.max_batch_tokens - (len(plan.decode) if self.decode_rows_in_budget else 0)
        if self.step_cost is not None and plan.decode and budget > 0:
            budget = self.step_cost.prefill_budget(len(plan.decode), budget)
        for seq in self.running:
            if seq.pending < 2 or budget <= 0:
                continue
            chunk = min(seq.pending, self.next_boundary(seq) - seq.computed, budget)
            plan.prefill.append((seq, chunk))
            budget -= chunk

    def next_boundary(self, seq: Sequence) -> int:
        """First position after `computed` where a prefill chunk must end."""
        end = len(seq.tokens)
        later = [p for p in seq.branch_points if p > seq.computed]
        if later:
            end = min(end, min(later))
        if seq.computed < seq.prompt_len:
            interval_mark = (seq.computed // self.track_interval + 1) * self.track_interval
            if interval_mark <= seq.prompt_len:
                end = min(end, interval_mark)
        return end

    # ---- after the model ran -----------------------------------------------------------------
    def advance(self, items: list[tuple[Sequence, int]]) -> None:
        """Each (sequence, n) computed n more tokens; a state reached at a branch point or a
        tracking interval is snapshot and donated to the tree at once (planned followers may be
        admitted next step), and kept until they are: eviction takes states nobody awaits first."""
        for seq, n in items:
            seq.advance(n)
            if self._tracks_here(seq) and self.cache.track(seq.handle, seq.computed):
                self.cache.donate(seq.handle)
                self.cache.expect_followers(seq.handle, seq.computed, self.followers_expected(seq, seq.computed))

    def _tracks_here(self, seq: Sequence) -> bool:
        """Whether the state at `seq.computed` (just reached) is at a branch point or a tracking interval."""
        p = seq.computed
        return 0 < p <= seq.prompt_len and (p in seq.branch_points or p % self.track_interval == 0)

    # ---- admission -------------------------------------------------------------------------
    def _admit(self, plan: StepPlan) -> None:
        self.waiting.tidy()
        free_places = self.max_running - len(self.running)
        self._scan(plan, limit=max(1, free_places) * _ADMISSION_SCAN_FACTOR)
        if self.wait_for_leaders and not self.running and self.waiting:
            # Nothing runs, so nothing will free room: look at every waiting row; if none fits
            # still, the plan needs more live branch states than the pool holds.
            self._scan(plan, limit=None)
            if not self.running and self.waiting:
                self._admit_over_capacity(plan)

    def _scan(self, plan: StepPlan, limit) -> None:
        """Admit waiting sequences in plan order, skipping those whose leader has not reached
        their branch point yet or whose admission would not fit (`_fits`)."""
        free_places = self.max_running - len(self.running)
        scanned, head = 0, True  # head: every entry before this one was admitted
        for position, seq in self.waiting.entries():
            if free_places <= 0 or (limit is not None and scanned >= limit):
                break
            scanned += 1
            if self.wait_for_leaders and not (seq.is_ready() and self._fits(seq, head)):
                head = False
                continue
            if not self._try_admit(plan, position, seq):
                break  # keep plan order: wait for running sequences to free room
            free_places -= seq.handle is not None  # not when it failed

    def _try_admit(self, plan: StepPlan, position: int, seq: Sequence, dropped: tuple[int, ...] = ()) -> bool:
        """Admit `seq` (at `position` in the queue); False when the cache has no room for it now.
        `dropped`: branch depths it leads whose states the pool cannot hold (nothing expects them)."""
        first = seq.cached_tokens is None
        scored = seq.request.score_tokens  # its continuation's positions need logits: never resumed past them
        handle = self.cache.admit(id(seq), seq.tokens,
                                  planned_resume=seq.planned_reuse if first and seq.leader is not None else 0,
                                  max_resume=len(seq.tokens) - scored - 1 if scored else None)
        if handle is None:
            if self.running:
                return False
            self.waiting.take(position)  # nothing will ever free room for it
            plan.failed.append(seq)
            seq.set_error(f"the cache cannot hold this sequence ({len(seq.tokens)} tokens) even alone")
            if first:
                self._follower_gone(seq, admitted=False)
            return True
        self.waiting.take(position)
        self._start(seq, handle)
        if first:
            self._note_first_admission(seq, handle, dropped)
        return True

    def _fits(self, seq: Sequence, head: bool) -> bool:
        """Whether admitting `seq` keeps every live branch state within the state pool.

        The pool holds one working slot per running sequence plus the branch states still
        awaited (leader admitted, a follower not yet): in DFS order those are the branches
        whose run of rows holds an admitted row. Admission peaks while the new working slot
        is filled from a branch state that is still held; a leader's first admission then adds
        one state per branch it leads, a follower's removes its branch's when it is the last.
        Beyond `branch_state_capacity` live branches only the head of the plan may open more:
        later leaders wait, so followers keep finding working slots and the head always moves."""
        live = len(self._live_branches)
        peak = len(self.running) + 1 + live
        if seq.cached_tokens is not None:  # re-admission after preemption: a working slot only
            return peak <= self.state_slots
        opens = len(seq.followers)
        closes = int(self._live_branches.get((seq.leader, seq.planned_reuse)) == 1)
        if peak + max(0, opens - closes) > self.state_slots:
            return False
        return head or opens <= closes or live + opens - closes <= self.branch_state_capacity

    def _admit_over_capacity(self, plan: StepPlan) -> None:
        """Nothing runs and no waiting row fits: the head of the plan (ready: its leader is done)
        goes in with only as many of its branch states as the pool still holds, its deepest
        ones given up (their followers recompute from a shallower state; counted)."""
        position, seq = next(self.waiting.entries())
        dropped: tuple[int, ...] = ()
        if seq.cached_tokens is None and seq.followers:
            closes = int(self._live_branches.get((seq.leader, seq.planned_reuse)) == 1)
            room = max(0, self.state_slots - 1 - len(self._live_branches) + closes)
            dropped = tuple(sorted(seq.followers)[room:])
            self.tally.add(branch_states_over_capacity=len(dropped))
        self._try_admit(plan, position, seq, dropped)

    def followers_expected(self, seq: Sequence, depth: int) -> int:
        """Planned followers still to be admitted from the branch state `seq` leads at `depth`
        (0 when none, or when that state was given up for want of room)."""
        return self._live_branches.get((seq, depth), 0)

    def _note_first_admission(self, seq: Sequence, handle, dropped: tuple[int, ...]) -> None:
        self._follower_gone(seq, admitted=True)
        for depth, followers in seq.followers.items():
            if depth in dropped:
                continue
            self._live_branches[(seq, depth)] = len(followers)
            # Resumed at or past it (the tree had states from earlier work): the state must be
            # there now, or there is nothing to keep for the followers.
            if depth <= handle.resume_len and not self.cache.expect_followers(handle, depth, len(followers)):
                del self._live_branches[(seq, depth)]

    def _follower_gone(self, seq: Sequence, admitted: bool) -> None:
        """`seq` no longer waits for its branch state: the last follower to go closes the
        branch. An admission told the cache itself (`admit`'s planned_resume); one that
        failed before it must, or the state would be held for it for good."""
        key = (seq.leader, seq.planned_reuse)
        left = self._live_branches.get(key)
        if left is None:
            return
        if left > 1:
            self._live_branches[key] = left - 1
        else:
            del self._live_branches[key]
        if not admitted:
            self.cache.forget_followers(seq.leader.tokens, seq.planned_reuse, 1)

    def _start(self, seq: Sequence, handle) -> None:
        if seq.cached_tokens is not None:  # re-admitted after preemption
            self.tally.add(recomputed_tokens=len(seq.tokens) - handle.resume_len)
        seq.admitted(handle)
        # KV matched past the resume point, for want of a state there. The last token is always
        # recomputed (it yields the logits), so a KV hit on it is not counted as discarded.
        usable_kv = min(handle.matched_kv_len, len(seq.tokens) - 1)
        self.tally.add(discarded_kv_tokens=max(0, usable_kv - handle.resume_len))
        self.running.append(seq)

    # ---- decode slots and preemption -------------------------------------------------------
    def _reserve_decode_slots(self, plan: StepPlan) -> bool:
        """KV slots for every decode token; preempt the youngest sequences when there are none.

        Usually every token fits: one allocation for the whole batch (`append_many`). Only when
        it does not are the sequences served one by one, preempting as they go — after the
        tokens in flight reached the host, since a preempted sequence must know its tokens:
        False (`plan.needs_host_tokens`) when some are still in flight."""
        decoding = [seq for seq in self.running if seq.handle is not None and seq.pending == 1
                    and not seq.awaits_last_token(self.max_model_len)]
        # The token fed now sits at index `computed` (on the host, or still on the device); the
        # handle lacks its KV slot unless it is a token the sequence was admitted with.
        needing = [seq.handle for seq in decoding if seq.handle.num_tokens == seq.computed]
        if self.cache.append_many(needing):
            plan.decode.extend(decoding)
            return True
        if any(seq.awaiting for seq in self.running):
            plan.needs_host_tokens = True
            return False
        self._reserve_one_by_one(plan)
        return True

    def _reserve_one_by_one(self, plan: StepPlan) -> None:
        for seq in list(self.running):
            if seq.pending != 1 or seq.handle is None:
                continue
            missing = len(seq.tokens) - seq.handle.num_tokens  # the last sampled token, not yet fed
            while missing and self.cache.append(seq.handle, missing) is None:
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    self._drop(seq)
                    plan.failed.append(seq)
                    seq.set_error(f"the KV cache cannot hold this sequence ({len(seq.tokens)} tokens) even alone")
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                plan.decode.append(seq)
        plan.decode = [s for s in plan.decode if s.handle is not None]

    def preempt(self, seq: Sequence) -> None:
        self._drop(seq, recompute=True)
        self.waiting.insert(seq)
        self.tally.add(preemptions=1)

    def _drop(self, seq: Sequence, recompute: bool = False) -> None:
        self.cache.abort(seq.handle)
        seq.released(recompute)
        self.running.remove(seq)

    # ---- completion ------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """`seq` stopped: the KV and state of every token fed (a token in flight too) go to the tree."""
        self.cache.finish(seq.handle, seq.computed)
        seq.released()
        self.running.remove(seq)

    def abandon(self) -> None:
        """Drop every queued and running sequence (their slots go back; the tree stays)."""
        for seq in list(self.running):
            self._drop(seq)
        self.waiting.clear()
        for (leader, depth), left in self._live_branches.items():
            self.cache.forget_followers(leader.tokens, depth, left)
        self._live_branches.clear()
