"""Predicted balance of work units over N workers: largest estimated cost first, to the least loaded.

This is the executor's policy (a free worker takes the largest unit left), simulated with
the units' estimated costs: LPT list scheduling. The ideal no schedule can beat is the
larger of total / N and the largest unit.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Balance:
    workers: int
    loads: tuple[float, ...]        # estimated cost per worker
    unit_counts: tuple[int, ...]    # units per worker
    makespan: float                 # the most loaded worker's cost
    ideal: float                    # max(total / workers, largest unit)

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


def predict_balance(costs: Sequence[float], workers: int) -> Balance:
    """LPT: units by cost, largest first (ties by position), each to the least-loaded worker (lowest index on ties)."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    loads = [0.0] * workers
    counts = [0] * workers
    heap = [(0.0, worker) for worker in range(workers)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, worker = heapq.heappop(heap)
        loads[worker] = load + costs[index]
        counts[worker] += 1
        heapq.heappush(heap, (loads[worker], worker))
    total = float(sum(costs))
    ideal = max(total / workers, max(costs, default=0.0))
    return Balance(workers=workers, loads=tuple(loads), unit_counts=tuple(counts), makespan=max(loads), ideal=ideal)
