"""The sequences waiting for admission, in priority (plan) order.

A work unit can hold far more rows than one admission step looks at, and admission takes
sequences from anywhere in the first few hundred (a follower waits for its leader while later
leaders go in): a plain list would pay a shift of everything behind each one taken. Here a
taken sequence leaves a hole, skipped by iteration and squeezed out when holes dominate.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Iterable, Iterator, Optional

from batchinfer.engine.sequence import Sequence

_COMPACT_MIN_HOLES = 1024  # below this many holes, squeezing them out costs more than skipping them


def _priority(seq: Sequence) -> tuple[int, int]:
    return seq.priority


class WaitQueue:
    def __init__(self) -> None:
        self._items: list[Optional[Sequence]] = []  # priority order; None where a sequence was taken
        self._head = 0                              # no live entry before this index
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, seq in self.entries())

    def entries(self) -> Iterator[tuple[int, Sequence]]:
        """(position, sequence) of the live entries, head first. Positions stay valid while
        iterating and taking (`take`); `add` and `insert` invalidate them."""
        items = self._items
        for i in range(self._head, len(items)):
            seq = items[i]
            if seq is not None:
                yield i, seq

    def take(self, position: int) -> Sequence:
        seq = self._items[position]
        if seq is None:
            raise KeyError(f"no sequence waits at position {position}")
        self._items[position] = None
        self._live -= 1
        while self._head < len(self._items) and self._items[self._head] is None:
            self._head += 1
        return seq

    def add(self, seqs: Iterable[Sequence]) -> None:
        """Queue many sequences (a planned unit): a merge, not one insertion each."""
        new = sorted(seqs, key=_priority)
        if not new:
            return
        self._compact(force=True)  # units come seldom: a pass over the queue is cheap here
        if not self._items or self._items[-1].priority < new[0].priority:
            self._items.extend(new)  # the usual case: a unit queued after everything waiting
        else:
            self._items = list(heapq.merge(self._items, new, key=_priority))
        self._live += len(new)

    def insert(self, seq: Sequence) -> None:
        """Queue one sequence back in its place (a preempted one)."""
        self._compact(force=True)
        bisect.insort(self._items, seq, key=_priority)
        self._live += 1

    def tidy(self) -> None:
        """Squeeze out the holes once they outnumber the waiting sequences (call between scans)."""
        self._compact()

    def clear(self) -> None:
        self._items, self._head, self._live = [], 0, 0

    def _compact(self, force: bool = False) -> None:
        holes = len(self._items) - self._live
        if holes and (force or holes >= max(_COMPACT_MIN_HOLES, self._live)):
            self._items = [seq for seq in self._items[self._head:] if seq is not None]
            self._head = 0
