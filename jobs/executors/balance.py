"""Predicted balance of units over N workers: the greedy LPT rule the executors follow.

Both executors hand the largest pending unit to whichever worker frees up first; with exact
costs that is Graham's LPT schedule, whose makespan is at most 4/3 - 1/(3N) of the optimum and,
for many small units, close to the ideal max(total / N, largest unit). `batchinfer plan
--workers N` prints this prediction from the plan's estimated unit costs.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Balance:
    workers: int
    worker_costs: tuple[float, ...]    # estimated cost each worker runs; (workers,)
    assignment: tuple[int, ...]        # the worker of each unit, in the input order; (units,)
    total_cost: float
    makespan: float                    # the largest worker cost
    ideal: float                       # max(total / workers, largest unit): no schedule does better

    @property
    def ratio(self) -> float:
        """Makespan over the ideal: 1.0 is perfect balance."""
        return self.makespan / self.ideal if self.ideal > 0 else 1.0


def predict_balance(unit_costs: Sequence[float], workers: int) -> Balance:
    """Assign units, largest first, to the least-loaded worker (ties: the lowest index)."""
    if workers < 1:
        raise ValueError("workers must be at least 1")
    if any(cost < 0 for cost in unit_costs):
        raise ValueError("unit costs must not be negative")
    loads = [(0.0, worker) for worker in range(workers)]  # heap of (cost so far, worker)
    assignment = [0] * len(unit_costs)
    worker_costs = [0.0] * workers
    # Same order as UnitQueue: cost descending, then position (the unit id there).
    for index in sorted(range(len(unit_costs)), key=lambda i: (-unit_costs[i], i)):
        load, worker = heapq.heappop(loads)
        assignment[index] = worker
        worker_costs[worker] = load + unit_costs[index]
        heapq.heappush(loads, (worker_costs[worker], worker))
    total = float(sum(unit_costs))
    ideal = max(total / workers, max(unit_costs, default=0.0))
    return Balance(workers=workers, worker_costs=tuple(worker_costs), assignment=tuple(assignment),
                   total_cost=total, makespan=max(worker_costs), ideal=ideal)
