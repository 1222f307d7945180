"""The units still to run, largest estimated cost first, with a retry limit per unit.

Handing the most expensive unit to whichever worker is free next is the greedy LPT rule (see
`balance.py`): no static shards, so no worker idles while another still holds a long queue.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from batchinfer.jobs.run.executors.balance import dispatch_key


@dataclass(frozen=True)
class UnitSpec:
    """A unit as the executor sees it: its id, its estimated cost, and the samples it holds."""

    unit_id: int
    cost: float
    samples: int = 0     # (row, sample) pairs, for progress and ETA; 0 when unknown


class UnitQueue:
    """Pending units in cost order; in-flight and finished units; attempts per unit."""

    def __init__(self, units: Sequence[UnitSpec], max_attempts: int) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        ids = [unit.unit_id for unit in units]
        if len(set(ids)) != len(ids):
            raise ValueError("unit ids must be unique")
        self.units = {unit.unit_id: unit for unit in units}
        self.max_attempts = max_attempts
        # The order predict_balance assumes; ties broken by unit id, so every run (and test) is deterministic.
        self._heap = [dispatch_key(unit.cost, unit.unit_id) for unit in units]
        heapq.heapify(self._heap)
        self.in_flight: set[int] = set()
        self.finished: set[int] = set()
        self.attempts: dict[int, int] = {unit_id: 0 for unit_id in ids}
        self.last_failure: dict[int, str] = {}

    def take(self) -> Optional[int]:
        """The most expensive pending unit, now in flight; None when nothing is pending."""
        if not self._heap:
            return None
        unit_id = heapq.heappop(self._heap)[1]
        self.in_flight.add(unit_id)
        self.attempts[unit_id] += 1
        return unit_id

    def finish(self, unit_id: int) -> None:
        self.in_flight.discard(unit_id)
        self.finished.add(unit_id)

    def fail(self, unit_id: int, reason: str) -> bool:
        """Its worker died or raised. Back to the queue unless it used all its attempts (then False)."""
        self.in_flight.discard(unit_id)
        self.last_failure[unit_id] = reason
        if self.attempts[unit_id] >= self.max_attempts:
            return False
        heapq.heappush(self._heap, dispatch_key(self.units[unit_id].cost, unit_id))
        return True

    @property
    def pending(self) -> int:
        return len(self._heap)

    @property
    def unfinished(self) -> int:
        """Units pending or in flight: while this is above zero, workers are still needed."""
        return len(self._heap) + len(self.in_flight)

    @property
    def retried(self) -> list[int]:
        return sorted(unit_id for unit_id, attempts in self.attempts.items() if attempts > 1)
