"""The dispatch loop both executors share: free worker gets the largest unit, dead worker's unit goes back.

A transport (processes with pipes, or Ray actors) starts workers, hands them units and reports
events; this loop owns every decision: the order of units, retries, restarts, when the job has
failed, and the accounting. The exactly-once rule needs nothing here: a unit's part names are fixed
by the unit, so running it again after a crash rewrites the same names.
"""
from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from jobs.executors.contract import ProgressDelta, UnitResult
from jobs.executors.tally import ProgressSnapshot, Tally
from jobs.executors.unit_queue import UnitQueue, UnitSpec


@dataclass(frozen=True)
class Ready:
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
    """The worker is gone (exit, signal, exception, lost actor); `unit_id` is what it was running."""

    slot: int
    unit_id: Optional[int]
    reason: str


Event = Union[Ready, Progress, Finished, Died]


class Transport(Protocol):
    """How workers are reached; one worker per slot at a time."""

    def start(self, slot: int) -> None:
        """Start (or restart) the slot's worker; it answers Ready when loaded, or Died."""

    def assign(self, slot: int, unit_id: int) -> None:
        """Hand a ready, idle worker one unit; it answers Finished or Died."""

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


_STARTING, _IDLE, _BUSY, _DEAD = "starting", "idle", "busy", "dead"


class StopFlag:
    """Set by SIGINT / SIGTERM (or by a caller's `stop()`): hand out no more units, terminate workers."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self, *_: Any) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


class _SignalsStop:
    """While running in the main thread, SIGINT and SIGTERM set the flag instead of killing the parent."""

    def __init__(self, flag: StopFlag) -> None:
        self.flag = flag
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "_SignalsStop":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
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
    running: list[Optional[int]] = [None] * len(devices)
    restarts = [0] * len(devices)
    failure: Optional[str] = None
    last_progress = tally.clock()

    def dispatch() -> None:
        for slot, slot_state in enumerate(state):
            if slot_state == _IDLE and failure is None and not stop:
                unit_id = queue.take()
                if unit_id is None:
                    return
                state[slot], running[slot] = _BUSY, unit_id
                tally.unit_started(slot, unit_id)
                transport.assign(slot, unit_id)

    def handle(event: Event) -> None:
        nonlocal failure
        if isinstance(event, Ready):
            state[event.slot] = _IDLE
            tally.worker_ready(event.slot)
        elif isinstance(event, Progress):
            tally.progress(event.unit_id, event.delta)
        elif isinstance(event, Finished):
            queue.finish(event.result.unit_id)
            tally.unit_finished(event.slot, event.result)
            state[event.slot], running[event.slot] = _IDLE, None
        elif isinstance(event, Died):
            slot, unit_id = event.slot, running[event.slot]
            state[slot], running[slot] = _DEAD, None
            tally.worker_died(slot, unit_id, event.reason)
            if unit_id is not None and not queue.fail(unit_id, event.reason) and failure is None:
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
                if queue.unfinished == 0 or (failure is not None and _BUSY not in state):
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
                           results=dict(tally.results))
