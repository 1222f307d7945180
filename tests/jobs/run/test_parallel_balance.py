"""What `batchinfer plan --workers N` predicts is what the executors do: the same order, the same assignment.

A simulated transport runs each unit for exactly its estimated cost (on a virtual clock), so the
dispatch loop's real decisions can be compared with `predict_balance` unit by unit.
"""
from __future__ import annotations

import heapq
import random

import pytest

from batchinfer.jobs.run.executors.balance import predict_balance
from batchinfer.jobs.run.executors.contract import UnitResult
from batchinfer.jobs.run.executors.dispatch import Finished, Ready, Want, run_dispatch
from batchinfer.jobs.run.executors.unit_queue import UnitQueue, UnitSpec


class SimulatedTransport:
    """Workers are ready at once; a unit finishes `cost` virtual seconds after it was assigned, and its
    worker then asks for the next (as a worker without an overlapping engine does)."""

    def __init__(self, costs: list[float]) -> None:
        self.costs = costs
        self.now = 0.0
        self.pending_ready: list[int] = []
        self.running: list[tuple[float, int, int]] = []   # heap of (finish time, slot, unit)
        self.assigned: dict[int, int] = {}                # unit -> slot

    def start(self, slot: int) -> None:
        self.pending_ready.append(slot)

    def assign(self, slot: int, unit_id: int) -> None:
        self.assigned[unit_id] = slot
        heapq.heappush(self.running, (self.now + self.costs[unit_id], slot, unit_id))

    def poll(self, timeout: float):
        if self.pending_ready:
            ready, self.pending_ready = self.pending_ready, []
            return [Ready(slot) for slot in ready]
        if not self.running:
            return []
        # One event at a time: the earliest finish (ties: the lowest slot, as LPT's heap breaks them).
        self.now, slot, unit_id = heapq.heappop(self.running)
        return [Finished(slot, UnitResult(unit_id, samples_written=1)), Want(slot)]

    def drain(self, slot: int) -> None:
        pass

    def shutdown(self, graceful: bool) -> None:
        pass


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_dispatch_with_exact_costs_assigns_every_unit_where_predict_balance_says(workers):
    rng = random.Random(workers)
    costs = [float(rng.choice([1, 2, 3, 5, 8, 13, 40])) for _ in range(60)]  # many ties
    transport = SimulatedTransport(costs)
    report = run_dispatch(transport, [UnitSpec(unit, cost) for unit, cost in enumerate(costs)],
                          ["cpu"] * workers, "simulated")
    assert report.status == "done"
    predicted = predict_balance(costs, workers)
    assert tuple(transport.assigned[unit] for unit in range(len(costs))) == predicted.assignment
    assert transport.now == pytest.approx(predicted.makespan)


def test_the_queue_takes_units_in_the_order_the_prediction_assigns_them():
    costs = [3.0, 9.0, 3.0, 1.0, 9.0, 0.0, 4.0]
    queue = UnitQueue([UnitSpec(unit, cost) for unit, cost in enumerate(costs)], max_attempts=1)
    taken = [queue.take() for _ in costs]
    assert taken == [1, 4, 6, 0, 2, 3, 5]
    one_worker = predict_balance(costs, 1)
    assert one_worker.unit_counts == (len(costs),) and one_worker.makespan == sum(costs)
