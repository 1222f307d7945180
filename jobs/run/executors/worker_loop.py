"""The worker's side of the protocol, shared by worker processes and Ray actors.

A worker builds its `UnitWorker` once, says `ready`, then serves sessions. A session starts with
a unit from the parent and streams units into the worker's `run_units`: whenever the worker's
engine has room for more work it pulls the next unit id, and the loop asks the parent (`want`)
and blocks until the parent answers with a unit or with `drain` (nothing left for now: finish
what you hold). So an engine keeps its batch full across unit boundaries, units are handed out
one at a time as engines have room (no unit waits in a busy worker's queue), and the parent,
which answers every `want` at once, decides every assignment. A worker without `run_units` runs
its units one after another, asking for the next when the previous is done.

Messages, parent → worker: ("unit", id), ("drain",), ("close",).
Worker → parent: ("ready",), ("want",), ("progress", id, delta), ("done", result), ("failed", reason).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, Iterator, Optional

from batchinfer.jobs.run.executors.contract import RateLimitedSink, UnitResult, UnitWorker, WorkerRecipe
from batchinfer.jobs.outdir.interruption import Stopped

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_PID_ENV = "BATCHINFER_WORKER_PARENT"  # set in a local worker process: the pid of the run that started it

Receive = Callable[[], Optional[tuple]]   # the next message; None when the parent is gone
Send = Callable[[tuple], None]
WORKER_IGNORES = (signal.SIGINT, signal.SIGHUP)  # reach the whole process group: only the parent decides


class StopRequested(Stopped):
    """The parent ended the run (it sends a worker process SIGTERM): no unit runs again in this run,
    so a worker may commit what its open units hold before it exits."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)


class ParentGone(RuntimeError):
    """The process that started this worker is gone (its lock counts as stale): commit nothing more."""


def watch_parent(parent_pid: int) -> None:
    """Die with the parent (Linux: PR_SET_PDEATHSIG, SIGKILL at once: an orphan must not commit while
    another run may hold the folder), and name it in PARENT_PID_ENV for the check before each commit
    (`parent_alive`; the only guard where the signal is missing). The signal follows the parent thread
    that started the worker: the executor's dispatch thread, which outlives its workers."""
    os.environ[PARENT_PID_ENV] = str(parent_pid)
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the check alone
        pass


def parent_alive() -> None:
    """Raise ParentGone unless the parent named by `watch_parent` is still this process's parent (an
    orphan is re-parented); nothing to check outside a local worker process."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and os.getppid() != int(parent):
        raise ParentGone(f"the parent process {parent} is gone")


def describe_exception(exc: BaseException) -> str:
    """One line: type and the first line of the message, bounded."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message}"[:500] if message else type(exc).__name__


def stream_units(worker: UnitWorker, unit_ids: Iterator[int]) -> Iterator[UnitResult]:
    """The worker's own `run_units` when it has one (engines that overlap units), else one unit at a time."""
    run_units = getattr(worker, "run_units", None)
    if callable(run_units):
        return run_units(unit_ids)
    return (worker.run_unit(unit_id) for unit_id in unit_ids)


def serve(recipe: WorkerRecipe, worker_index: int, device: str, receive: Receive, send: Send,
          progress_interval: float, before_open: Callable[[], None] = lambda: None) -> None:
    """Build and open the worker, serve sessions until `close` (or the parent is gone), close it.

    Any exception is reported as ("failed", reason) and re-raised: the caller's process or actor ends.
    """
    sink = RateLimitedSink(lambda unit_id, delta: send(("progress", unit_id, delta)), progress_interval)
    try:
        worker = recipe.build()
        before_open()
        worker.open(worker_index, device, sink)
        send(("ready",))
        closing = False
        while not closing:
            message = receive()
            if message is None or message[0] == "close":
                break
            if message[0] != "unit":  # a drain that crossed the end of a session: nothing to stop
                continue

            def feed(first: int) -> Iterator[int]:
                nonlocal closing
                yield first
                while True:
                    send(("want",))
                    answer = receive()
                    if answer is None or answer[0] == "close":
                        closing = True
                        return
                    if answer[0] == "drain":
                        return
                    yield answer[1]

            for result in stream_units(worker, feed(message[1])):
                sink.discard(result.unit_id)
                send(("done", result))
        worker.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        try:
            send(("failed", describe_exception(exc)))
        except Exception:
            pass
        raise


def exit_after_failure(function: Callable[..., Any], *args: Any) -> None:
    """Run `function`; a failure (already reported) ends the process with status 1, without a traceback."""
    try:
        function(*args)
    except BaseException:
        sys.exit(1)
