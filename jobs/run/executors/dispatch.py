"""The dispatch loop both executors share: a worker with room gets the largest unit, a dead worker's units go back.

A transport (processes with pipes, or Ray actors) starts workers, hands them units and reports
events; this loop owns every decision: the order of units, retries, restarts, when the job has
failed, and the accounting. A worker asks for work (`Ready` at first, then `Want` whenever its
engine has room) and is answered at once: the largest pending unit, or `drain` when none is
pending. So a worker may hold several units at a time (an engine overlaps the end of one unit
with the start of the next), and no unit is ever queued behind a busy worker. The exactly-once
rule needs nothing here: a unit's part names are fixed by the unit, so running it again after a
crash rewrites the same names.
"""
from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from batchinfer.jobs.run.executors.contract import ProgressDelta, UnitResult
from batchinfer.jobs.run.executors.tally import ProgressSnapshot, Tally
from batchinfer.jobs.run.executors.unit_queue import UnitQueue, UnitSpec
from batchinfer.jobs.outdir.interruption import STOP_SIGNALS


@dataclass(frozen=True)
class Ready:
    """The worker is loaded and holds no unit."""

    slot: int


@dataclass(frozen=True)
class Want:
    """The worker's engine has room for another unit; it waits for a unit or `drain`."""

    slot: int


@dataclass(frozen=True)
class Progress:
    slot: int
    unit_id: int
    delta: ProgressDelta


@dataclass(frozen=True)
class Finished:
    slot: int
    result: UnitResult


@dataclass(frozen=True)
class Died:
    """The worker is gone (exit, signal, exception, lost actor) with whatever units it held."""

    slot: int
    reason: str


Event = Union[Ready, Want, Progress, Finished, Died]


class Transport(Protocol):
    """How workers are reached; one worker per slot at a time."""

    def start(self, slot: int) -> None:
        """Start (or restart) the slot's worker; it answers Ready when loaded, or Died."""

    def assign(self, slot: int, unit_id: int) -> None:
        """Answer a Ready or Want with one unit; the worker later answers Finished for it, or Died."""

    def drain(self, slot: int) -> None:
        """Answer a Want with: nothing more for now; finish the units you hold."""

    def poll(self, timeout: float) -> list[Event]:
        """Events that arrived, waiting at most `timeout` seconds for the first."""

    def shutdown(self, graceful: bool) -> None:
        """Stop every worker: graceful lets idle workers close (release the device), else terminate."""


@dataclass(frozen=True)
class RetryPolicy:
    max_unit_attempts: int = 3        # a unit that fails this often ends the job, naming it
    max_restarts_per_worker: int = 2  # then the slot stays dead; all slots dead ends the job


@dataclass(frozen=True)
class ExecutionReport:
    status: str                        # done | failed | interrupted
    failure: Optional[str]             # one line naming the unit or the workers' reasons
    stats: dict[str, Any]              # the executor's section of _stats.json
    results: dict[int, UnitResult] = field(default_factory=dict)
    interrupted_by: Optional[int] = None   # the stop signal that stopped the run (SIGINT, SIGTERM, SIGHUP), if one did


# STARTING: loading; IDLE: loaded, no session; WANT: waits for our answer; BUSY: runs units and will
# ask again; DRAINING: told to finish what it holds; DEAD: gone (restarted through STARTING).
_STARTING, _IDLE, _WANT, _BUSY, _DRAINING, _DEAD = "starting", "idle", "want", "busy", "draining", "dead"


class StopFlag:
    """Set by a stop signal, SIGINT / SIGTERM / SIGHUP (or by a caller's `stop()`): hand out no more units, terminate workers."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal: Optional[int] = None

    def set(self, signum: Optional[int] = None, *_: Any) -> None:
        if isinstance(signum, int) and self.signal is None:
            self.signal = signum
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


class _SignalsStop:
    """While running in the main thread, the stop signals (`jobs.outdir.interruption.STOP_SIGNALS`) set the flag
    instead of stopping the parent at once: it stops the workers, which commit what they finished."""

    def __init__(self, flag: StopFlag) -> None:
        self.flag = flag
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "_SignalsStop":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self.flag.set)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def run_dispatch(transport: Transport, units: Sequence[UnitSpec], devices: list[str], executor: str,
                 policy: RetryPolicy = RetryPolicy(), stop: Optional[StopFlag] = None,
                 on_progress: Optional[Callable[[ProgressSnapshot], None]] = None,
                 progress_interval: float = 1.0, poll_seconds: float = 0.2) -> ExecutionReport:
    """Run every unit on the transport's workers (one per entry of `devices`) until done, failed or stopped."""
    stop = stop if stop is not None else StopFlag()
    queue = UnitQueue(units, policy.max_unit_attempts)
    tally = Tally(queue.units, devices)
    state = [_STARTING] * len(devices)
    held: list[set[int]] = [set() for _ in devices]   # units each worker holds (assigned, not finished)
    restarts = [0] * len(devices)
    failure: Optional[str] = None
    last_progress = tally.clock()

    def answer(slot: int) -> None:
        """A worker asked (Ready or Want): the largest pending unit, or drain when none may be handed out."""
        unit_id = queue.take() if failure is None and not stop else None
        if unit_id is not None:
            state[slot] = _BUSY
            held[slot].add(unit_id)
            tally.unit_started(slot, unit_id)
            transport.assign(slot, unit_id)
        elif state[slot] == _WANT:
            transport.drain(slot)
            state[slot] = _DRAINING if held[slot] else _IDLE

    def dispatch() -> None:
        for slot, slot_state in enumerate(state):
            if slot_state in (_IDLE, _WANT):
                answer(slot)

    def handle(event: Event) -> None:
        nonlocal failure
        slot = event.slot
        if isinstance(event, Ready):
            state[slot] = _IDLE
            tally.worker_ready(slot)
        elif isinstance(event, Want):
            if state[slot] == _BUSY:
                state[slot] = _WANT
        elif isinstance(event, Progress):
            tally.progress(event.unit_id, event.delta)
        elif isinstance(event, Finished):
            unit_id = event.result.unit_id
            held[slot].discard(unit_id)
            queue.finish(unit_id)
            tally.unit_finished(slot, event.result)
            if state[slot] == _DRAINING and not held[slot]:
                state[slot] = _IDLE
        elif isinstance(event, Died):
            lost, held[slot] = sorted(held[slot]), set()
            state[slot] = _DEAD
            tally.worker_died(slot, lost, event.reason)
            for unit_id in lost:
                if not queue.fail(unit_id, event.reason) and failure is None:
                    failure = (f"unit {unit_id} failed on all {queue.attempts[unit_id]} attempts "
                               f"(max_unit_attempts); last: {event.reason}")
            if failure is None and not stop and queue.unfinished and restarts[slot] < policy.max_restarts_per_worker:
                restarts[slot] += 1
                state[slot] = _STARTING
                tally.worker_starting(slot, restart=True)
                transport.start(slot)

    status = "done"
    with _SignalsStop(stop):
        try:
            for slot in range(len(devices)):
                tally.worker_starting(slot, restart=False)
                transport.start(slot)
            while True:
                if stop:
                    status = "interrupted"
                    break
                if queue.unfinished == 0 or (failure is not None and not any(held)):
                    break
                if all(slot_state == _DEAD for slot_state in state):
                    reasons = "; ".join(f"worker {w.worker}: {w.failures[-1]}" for w in tally.workers if w.failures)
                    failure = failure or f"every worker failed ({reasons})"
                    break
                for event in transport.poll(poll_seconds):
                    handle(event)
                dispatch()
                if on_progress is not None and tally.clock() - last_progress >= progress_interval:
                    last_progress = tally.clock()
                    on_progress(tally.snapshot())
        finally:
            tally.finish()
            transport.shutdown(graceful=status == "done" and failure is None)
    if failure is not None and status == "done":
        status = "failed"
    if on_progress is not None:
        on_progress(tally.snapshot())
    return ExecutionReport(status=status, failure=failure,
                           stats=tally.stats(executor, status, failure, queue.retried),
                           results=dict(tally.results), interrupted_by=stop.signal if status == "interrupted" else None)
