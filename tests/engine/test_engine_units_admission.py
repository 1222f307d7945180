"""Admission bookkeeping without a model: the wait queue's order, and the state-pool rule."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from batchinfer.engine import wait_queue
from batchinfer.engine.scheduler import Scheduler
from batchinfer.engine.sequence import Sequence
from batchinfer.engine.stats import StatsTally
from batchinfer.engine.types import Request
from batchinfer.engine.wait_queue import WaitQueue


def make_seq(order: int, unit: int = 0, leader: Sequence | None = None, depth: int = 0) -> Sequence:
    return Sequence(Request(request_id=order, prompt_token_ids=(1, 2, 3, 4)), 0, (unit, order),
                    planned_reuse=depth, branch_points=frozenset(), leader=leader)


@pytest.mark.parametrize("min_holes", [1024, 2])  # 2: holes squeezed out as the queue runs
def test_wait_queue_keeps_priority_order_through_takes_and_inserts(monkeypatch, min_holes):
    monkeypatch.setattr(wait_queue, "_COMPACT_MIN_HOLES", min_holes)
    rng = random.Random(0)
    queue, model, taken = WaitQueue(), [], []
    first = [make_seq(i) for i in range(40)]
    rng.shuffle(first)
    queue.add(first)
    model += first
    for step in range(60):
        entries = list(queue.entries())
        assert [seq for _, seq in entries] == sorted(model, key=lambda s: s.priority)
        assert len(queue) == len(model) and bool(queue) == bool(model)
        if step == 10:  # sequences added while others wait, some ahead of them in priority
            later = [make_seq(i, unit=-1) for i in range(5)] + [make_seq(i, unit=1) for i in range(5)]
            queue.add(later)
            model += later
        elif step % 7 == 3 and taken:
            back = taken.pop()  # a preempted sequence returns to its place
            queue.insert(back)
            model.append(back)
        elif entries:
            position, seq = entries[rng.randrange(min(len(entries), 6))]
            assert queue.take(position) is seq
            model.remove(seq)
            taken.append(seq)
        queue.tidy()
    queue.clear()
    assert not queue and list(queue) == []


def test_leaders_beyond_the_pace_wait_unless_at_the_head():
    """Past `branch_state_capacity` live branch states only the plan's head opens more; a
    follower that closes a branch always may; none may pass the whole pool."""
    leaders = [make_seq(i) for i in range(3)]
    followers = [make_seq(10 + i, leader=leader, depth=2) for i, leader in enumerate(leaders)]
    scheduler = Scheduler(cache=None, max_running=8, max_batch_tokens=64, track_interval=64, wait_for_leaders=True,
                          tally=StatsTally(), state_slots=6, branch_state_capacity=2)
    scheduler.add(leaders + followers)
    for leader in leaders[:2]:
        scheduler._note_first_admission(leader, SimpleNamespace(resume_len=0), ())
    assert scheduler.followers_expected(leaders[0], 2) == 1
    assert not scheduler._fits(leaders[2], head=False)  # a third live branch: over the pace
    assert scheduler._fits(leaders[2], head=True)
    assert scheduler._fits(followers[0], head=False)     # closes its branch
    scheduler.running = leaders[:2] + [followers[1]]    # 3 working slots + 2 live branches of 6
    assert scheduler._fits(followers[0], head=False)
    assert not scheduler._fits(leaders[2], head=True)    # would need a 7th slot
