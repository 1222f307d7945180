"""What runs inside a worker: the `UnitWorker` contract, its result, its recipe and its progress.

An executor (local processes or Ray actors) sends each worker a picklable `WorkerRecipe`; the
worker builds its `UnitWorker` from it once (loading the model once), then runs the units the
parent hands it one at a time. The worker commits each unit's output itself, under part names
fixed by the unit and atomically, so a unit run twice rewrites the same names and the parent
never moves data: a dead worker's unit simply runs again elsewhere, skipping committed rows.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable


@dataclass(frozen=True)
class ProgressDelta:
    """Work done since the previous report of the same unit (counts add up)."""

    samples: int = 0          # (row, sample) pairs committed or finished
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: "ProgressDelta") -> "ProgressDelta":
        return ProgressDelta(self.samples + other.samples, self.prompt_tokens + other.prompt_tokens,
                             self.cached_tokens + other.cached_tokens, self.output_tokens + other.output_tokens)

    def __bool__(self) -> bool:
        return any((self.samples, self.prompt_tokens, self.cached_tokens, self.output_tokens))


@dataclass(frozen=True)
class UnitResult:
    """What one finished unit did; its rows are already committed when the parent receives it."""

    unit_id: int
    samples_written: int                  # by this attempt
    samples_skipped: int = 0              # found committed (an earlier attempt or run), not redone
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0                       # samples written with finish_reason "error"
    parts: tuple[str, ...] = ()           # part names the unit owns (fixed by the unit)
    counters: Mapping[str, float] = field(default_factory=dict)  # engine counters; summed, peak_* maxed


class ProgressSink(Protocol):
    """Where a worker reports progress; implementations bound the rate at which it travels."""

    def report(self, unit_id: int, delta: ProgressDelta) -> None: ...


@runtime_checkable
class UnitWorker(Protocol):
    """Runs inside a worker process or actor; one instance serves many units.

    A worker whose engine overlaps units (starts the next while the last sequences of one still
    decode) also defines `run_units(unit_ids: Iterator[int]) -> Iterator[UnitResult]`: it pulls the
    next id only when its engine has room for more work (the pull may wait for the parent) and yields
    each unit's result once that unit is committed, in any order. Without it, units run one at a time.
    """

    def open(self, worker_index: int, device: str, progress: ProgressSink) -> None:
        """Load what every unit needs (the model) once. `device` is e.g. "cuda:0" or "cpu"."""

    def run_unit(self, unit_id: int) -> UnitResult:
        """Run one unit and commit its output under the unit's fixed part names, skipping committed rows."""

    def close(self) -> None:
        """Release the device; called once when the parent has no more units for this worker."""


@dataclass(frozen=True)
class WorkerRecipe:
    """How a worker builds its `UnitWorker`: picklable, so no model ever crosses a process boundary.

    `factory` is "package.module:function", imported in the worker and called with the recipe.
    `overrides` are dotted job keys applied on top of the job file (e.g. "engine.memory_fraction"
    when two workers share one GPU).
    """

    factory: str
    job_file: Optional[str] = None
    job_name: Optional[str] = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def with_overrides(self, **extra: Any) -> "WorkerRecipe":
        return replace(self, overrides={**self.overrides, **extra})

    def build(self) -> UnitWorker:
        module_name, _, function_name = self.factory.partition(":")
        if not module_name or not function_name:
            raise ValueError(f"worker factory {self.factory!r} is not 'package.module:function'")
        function: Callable[[WorkerRecipe], UnitWorker] = getattr(importlib.import_module(module_name), function_name)
        return function(self)


class RateLimitedSink:
    """Accumulates deltas per unit and hands them to `send` at most once every `interval` seconds.

    A finished unit's leftover is discarded, not sent: its `UnitResult` replaces the parent's live
    counts of it anyway.
    """

    def __init__(self, send: Callable[[int, ProgressDelta], None], interval: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._interval = interval
        self._clock = clock
        self._pending: dict[int, ProgressDelta] = {}
        self._last_sent = clock()

    def report(self, unit_id: int, delta: ProgressDelta) -> None:
        self._pending[unit_id] = self._pending.get(unit_id, ProgressDelta()) + delta
        if self._clock() - self._last_sent >= self._interval:
            self.flush()

    def discard(self, unit_id: int) -> None:
        self._pending.pop(unit_id, None)

    def flush(self) -> None:
        self._last_sent = self._clock()
        pending, self._pending = self._pending, {}
        for unit_id, delta in pending.items():
            if delta:
                self._send(unit_id, delta)
