"""Predicted balance of units over N workers: the greedy LPT rule the executors follow.

Both executors hand the largest pending unit to whichever worker frees up first (`unit_queue.py`
takes units in `dispatch_key` order); with exact costs that is Graham's LPT schedule, whose
makespan is at most 4/3 - 1/(3N) of the optimum and, for many small units, close to the ideal
max(total / N, largest unit). `batchinfer plan --workers N` prints this prediction from the
plan's estimated unit costs, so what it predicts is the order the executors dispatch in.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


def dispatch_key(cost: float, unit_id: int) -> tuple[float, int]:
    """The order units are handed out in: largest estimated cost first, ties by unit id."""
    return (-cost, unit_id)


@dataclass(frozen=True)
class Balance:
    workers: int
    loads: tuple[float, ...]           # estimated cost each worker runs; (workers,)
    unit_counts: tuple[int, ...]       # units each worker runs; (workers,)
    assignment: tuple[int, ...]        # the worker of each unit, in the input order; (units,)
    makespan: float                    # the most loaded worker's cost
    ideal: float                       # max(total / workers, largest unit): no schedule does better

    @property
    def total(self) -> float:
        return float(sum(self.loads))

    @property
    def overhead(self) -> float:
        """makespan / ideal - 1: 0.03 means the job would finish 3% after the ideal."""
        return self.makespan / self.ideal - 1.0 if self.ideal else 0.0

    def to_dict(self) -> dict:
        return {"workers": self.workers, "loads": list(self.loads), "unit_counts": list(self.unit_counts),
                "makespan": self.makespan, "ideal": self.ideal, "overhead": self.overhead}


def predict_balance(unit_costs: Sequence[float], workers: int) -> Balance:
    """Assign units in dispatch order (the unit's position is its id) to the least-loaded worker
    (ties: the lowest index, as the dispatch loop serves free workers)."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if any(cost < 0 for cost in unit_costs):
        raise ValueError("unit costs must not be negative")
    heap = [(0.0, worker) for worker in range(workers)]  # (cost so far, worker)
    assignment = [0] * len(unit_costs)
    loads = [0.0] * workers
    counts = [0] * workers
    for index in sorted(range(len(unit_costs)), key=lambda i: dispatch_key(unit_costs[i], i)):
        load, worker = heapq.heappop(heap)
        assignment[index] = worker
        loads[worker] = load + unit_costs[index]
        counts[worker] += 1
        heapq.heappush(heap, (loads[worker], worker))
    total = float(sum(unit_costs))
    ideal = max(total / workers, max(unit_costs, default=0.0))
    return Balance(workers=workers, loads=tuple(loads), unit_counts=tuple(counts), assignment=tuple(assignment),
                   makespan=max(loads), ideal=ideal)
