"""The parent's account of a run: live progress across workers and the per-worker statistics.

Live counts of a unit come from its worker's progress events; when the unit finishes, its
`UnitResult` replaces them (exact totals), and when its worker dies they are dropped (the rerun
reports what it finds committed as skipped), so no sample is counted twice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from batchinfer.jobs.run.executors.contract import ProgressDelta, UnitResult
from batchinfer.jobs.run.executors.unit_queue import UnitSpec
from batchinfer.jobs.outdir.progress_time import eta_seconds


@dataclass(frozen=True)
class ProgressSnapshot:
    samples_done: int           # finished or found committed, plus live counts of running units
    samples_total: int          # 0 when the units do not say
    units_finished: int
    units_total: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    elapsed_seconds: float
    workers_busy: int
    samples_skipped: int = 0    # of samples_done, found committed (resumed): not this run's rate

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / max(self.elapsed_seconds, 1e-9)

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / max(self.elapsed_seconds, 1e-9)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def eta_seconds(self) -> Optional[float]:
        """Remaining samples at this run's sample rate; None without totals or until enough has run
        to estimate (`progress_time.eta_seconds`)."""
        if not self.samples_total:
            return None
        return eta_seconds(self.samples_done - self.samples_skipped, self.samples_total - self.samples_skipped,
                           self.elapsed_seconds)


@dataclass
class WorkerStats:
    """Accumulated while the run goes on, hence not frozen."""

    worker: int
    device: str
    units: int = 0
    samples: int = 0
    busy_seconds: float = 0.0
    load_seconds: float = 0.0
    restarts: int = 0
    failures: list[str] = field(default_factory=list)
    peaks: dict[str, float] = field(default_factory=dict)   # its units' peak_* counters (e.g. device memory)
    started_at: Optional[float] = None    # the current process / actor was asked to start
    ready_at: Optional[float] = None
    holding: int = 0                      # units it holds now (an engine may overlap two)
    busy_since: Optional[float] = None    # since when it has held at least one
    last_finish: Optional[float] = None

    def end_busy(self, now: float) -> None:
        if self.busy_since is not None:
            self.busy_seconds += now - self.busy_since
        self.busy_since = None


def _merge_counters(into: dict[str, float], counters: Mapping[str, float]) -> None:
    for name, value in counters.items():
        # Peaks are per device: the job's peak is the largest, not the sum.
        into[name] = max(into.get(name, value), value) if name.startswith("peak_") else into.get(name, 0) + value


def _idle_tail(worker: WorkerStats, last_unit: float) -> float:
    """From the worker's last finished unit (or its readiness) to the moment the last unit finished."""
    since = worker.last_finish if worker.last_finish is not None else worker.ready_at
    return max(0.0, last_unit - since) if since is not None else 0.0


class Tally:
    def __init__(self, units: Mapping[int, UnitSpec], devices: list[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.start = clock()
        self.units = units
        self.workers = [WorkerStats(worker=index, device=device) for index, device in enumerate(devices)]
        self.results: dict[int, UnitResult] = {}
        self.live: dict[int, ProgressDelta] = {}
        self.counters: dict[str, float] = {}
        self.end: Optional[float] = None

    def worker_starting(self, slot: int, restart: bool) -> None:
        worker = self.workers[slot]
        worker.started_at, worker.ready_at = self.clock(), None
        worker.restarts += restart

    def worker_ready(self, slot: int) -> None:
        worker = self.workers[slot]
        worker.ready_at = self.clock()
        if worker.started_at is not None:
            worker.load_seconds += worker.ready_at - worker.started_at

    def unit_started(self, slot: int, unit_id: int) -> None:
        worker = self.workers[slot]
        if worker.holding == 0:
            worker.busy_since = self.clock()
        worker.holding += 1
        self.live[unit_id] = ProgressDelta()

    def progress(self, unit_id: int, delta: ProgressDelta) -> None:
        if unit_id in self.live:  # a late event of a unit already finished or lost is ignored
            self.live[unit_id] = self.live[unit_id] + delta

    def unit_finished(self, slot: int, result: UnitResult) -> None:
        now = self.clock()
        worker = self.workers[slot]
        worker.units += 1
        worker.samples += result.samples_written
        worker.holding = max(worker.holding - 1, 0)
        if worker.holding == 0:  # busy time is the union of its units' times, not their sum
            worker.end_busy(now)
        worker.last_finish = now
        self.live.pop(result.unit_id, None)
        self.results[result.unit_id] = result
        _merge_counters(self.counters, result.counters)
        _merge_counters(worker.peaks, {name: value for name, value in result.counters.items()
                                       if name.startswith("peak_")})

    def worker_died(self, slot: int, unit_ids: Sequence[int], reason: str) -> None:
        worker = self.workers[slot]
        worker.end_busy(self.clock())  # time spent, even if lost
        worker.holding = 0
        worker.failures.append(reason)
        for unit_id in unit_ids:
            self.live.pop(unit_id, None)

    def finish(self) -> None:
        self.end = self.clock()
        for worker in self.workers:  # stopped or failed with units in hand: their time still counts
            worker.end_busy(self.end)

    def snapshot(self) -> ProgressSnapshot:
        finished = list(self.results.values())
        live = sum(self.live.values(), ProgressDelta())
        return ProgressSnapshot(
            samples_done=sum(r.samples_written + r.samples_skipped for r in finished) + live.samples,
            samples_total=sum(unit.samples for unit in self.units.values()),
            units_finished=len(finished), units_total=len(self.units),
            prompt_tokens=sum(r.prompt_tokens for r in finished) + live.prompt_tokens,
            cached_tokens=sum(r.cached_tokens for r in finished) + live.cached_tokens,
            output_tokens=sum(r.output_tokens for r in finished) + live.output_tokens,
            elapsed_seconds=(self.end or self.clock()) - self.start,
            workers_busy=sum(worker.holding > 0 for worker in self.workers),
            samples_skipped=sum(r.samples_skipped for r in finished))

    def stats(self, executor: str, status: str, failure: Optional[str], retried: list[int]) -> dict[str, Any]:
        """The executor's section of `_stats.json`."""
        end = self.end if self.end is not None else self.clock()
        # The idle tail ends when the last unit finished: what a better balance could have saved.
        last_unit = max((w.last_finish for w in self.workers if w.last_finish is not None), default=end)
        snap = self.snapshot()
        return {
            "executor": executor,
            "status": status,
            **({"failure": failure} if failure is not None else {}),
            "workers": len(self.workers),
            "units": len(self.units),
            "units_finished": snap.units_finished,
            "units_retried": retried,
            "samples_written": sum(r.samples_written for r in self.results.values()),
            "samples_skipped": sum(r.samples_skipped for r in self.results.values()),
            "errors": sum(r.errors for r in self.results.values()),
            "prompt_tokens": snap.prompt_tokens,
            "cached_tokens": snap.cached_tokens,
            "output_tokens": snap.output_tokens,
            "cache_hit_rate": snap.hit_rate,
            "wall_seconds": end - self.start,
            "prompt_tokens_per_second": snap.prompt_tokens_per_second,
            "output_tokens_per_second": snap.output_tokens_per_second,
            "counters": dict(self.counters),
            "per_worker": [{
                "worker": w.worker, "device": w.device, "units": w.units, "samples": w.samples,
                "busy_seconds": w.busy_seconds, "load_seconds": w.load_seconds,
                "idle_tail_seconds": _idle_tail(w, last_unit),
                "restarts": w.restarts, "failures": list(w.failures), **w.peaks,
            } for w in self.workers],
        }
