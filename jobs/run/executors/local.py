"""LocalExecutor: N worker processes on this host, one per GPU (or sharing the CPU cores).

Processes are started with the 'spawn' method (a fresh interpreter: no CUDA state or model copied
from the parent), each with its placement's environment (CUDA_VISIBLE_DEVICES, thread counts). The
parent talks to each worker over its own pipe, in the messages of `worker_loop.py`: units and
drains one way; readiness, requests for work, progress (rate-bounded), results and failures the
other. A worker that exits, is killed, or raises is detected through its process sentinel and
pipe; the dispatch loop then retries the units it held and restarts it.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Collection, Optional, Sequence

from batchinfer.jobs.run.executors.contract import WorkerRecipe
from batchinfer.jobs.run.executors.dispatch import (Died, Event, ExecutionReport, Finished, Progress, Ready, RetryPolicy,
                                     StopFlag, Want, run_dispatch)
from batchinfer.jobs.run.executors.placement import Placement
from batchinfer.jobs.run.executors.tally import ProgressSnapshot
from batchinfer.jobs.run.executors.unit_queue import UnitSpec
from batchinfer.jobs.run.executors.worker_loop import (WORKER_IGNORES, StopRequested, exit_after_failure,
                                                   serve, watch_parent)
from batchinfer.jobs.outdir.interruption import stop_on_signals
from batchinfer.jobs.run.environ import environ_set
from batchinfer.jobs.run.quiet_streams import quiet_when_closed

CLOSE_SECONDS = 30.0      # a worker asked to close gets this long to release its device
TERMINATE_SECONDS = 5.0   # then SIGTERM, then SIGKILL after this long

_ENV_LOCK = threading.Lock()


def describe_exit(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def describe_units(units: Collection[int], ready: bool) -> str:
    """Where a worker was when it died, for its failure line."""
    if units:
        ids = sorted(units)
        return f" while running unit {ids[0]}" if len(ids) == 1 else f" while running units {', '.join(map(str, ids))}"
    return "" if ready else " before it was ready"


def _receive(conn: Connection) -> Optional[tuple]:
    try:
        return conn.recv()
    except EOFError:  # the parent is gone: nobody will take our results
        return None


def _worker_main(placement: Placement, recipe: WorkerRecipe, conn: Connection, progress_interval: float,
                 parent_pid: int) -> None:
    """The worker process: the shared worker loop over this process's pipe, for as long as its parent lives."""
    # Ctrl-C and a hang-up reach the whole process group; only the parent decides what stops, with SIGTERM.
    for signum in WORKER_IGNORES:
        signal.signal(signum, signal.SIG_IGN)
    watch_parent(parent_pid)  # dies with the parent; the unit worker also checks it before each commit

    def set_threads() -> None:
        if placement.torch_threads is not None and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(placement.torch_threads)

    with quiet_when_closed(), stop_on_signals((signal.SIGTERM,), StopRequested):
        exit_after_failure(serve, recipe.with_overrides(**placement.overrides), placement.worker, placement.device,
                           lambda: _receive(conn), conn.send, progress_interval, set_threads)


@dataclass
class _Process:
    slot: int
    process: Any
    conn: Connection
    units: set[int] = field(default_factory=set)   # assigned and not finished
    ready: bool = False
    reported: bool = False       # its Died event was emitted


class _ProcessTransport:
    def __init__(self, placements: Sequence[Placement], recipe: WorkerRecipe, progress_interval: float) -> None:
        self.placements = placements
        self.recipe = recipe
        self.progress_interval = progress_interval
        self.context = multiprocessing.get_context("spawn")
        self.live: dict[int, _Process] = {}
        self.retired: list[_Process] = []   # dead or failed, joined at shutdown
        self.events: list[Event] = []

    def start(self, slot: int) -> None:
        placement = self.placements[slot]
        parent_conn, child_conn = self.context.Pipe(duplex=True)
        process = self.context.Process(target=_worker_main, name=f"batchinfer-worker-{slot}",
                                       args=(placement, self.recipe, child_conn, self.progress_interval,
                                             os.getpid()))
        with _ENV_LOCK, environ_set(placement.env):  # a spawned child inherits os.environ as it is at start()
            process.start()
        child_conn.close()  # so the parent sees EOF when the child is gone
        self.live[slot] = _Process(slot, process, parent_conn)

    def _send(self, worker: _Process, message: tuple) -> None:
        try:
            worker.conn.send(message)
        except OSError:  # it died since its last message: the sentinel will tell how
            pass

    def assign(self, slot: int, unit_id: int) -> None:
        worker = self.live[slot]
        worker.units.add(unit_id)
        self._send(worker, ("unit", unit_id))

    def drain(self, slot: int) -> None:
        self._send(self.live[slot], ("drain",))

    def _died(self, worker: _Process, what: str) -> None:
        if worker.reported:
            return
        worker.reported = True
        where = describe_units(worker.units, worker.ready)
        self.events.append(Died(worker.slot, f"worker {worker.slot} (pid {worker.process.pid}) {what}{where}"))
        del self.live[worker.slot]
        self.retired.append(worker)
        if worker.process.is_alive():  # it reported an exception: make sure it goes
            worker.process.terminate()

    def _read(self, worker: _Process) -> None:
        try:
            while not worker.reported and worker.conn.poll():
                message = worker.conn.recv()
                kind = message[0]
                if kind == "ready":
                    worker.ready = True
                    self.events.append(Ready(worker.slot))
                elif kind == "want":
                    self.events.append(Want(worker.slot))
                elif kind == "progress":
                    self.events.append(Progress(worker.slot, message[1], message[2]))
                elif kind == "done":
                    worker.units.discard(message[1].unit_id)
                    self.events.append(Finished(worker.slot, message[1]))
                elif kind == "failed":
                    self._died(worker, f"raised {message[1]}")
        except (EOFError, OSError):
            pass  # the pipe closed: the sentinel reports the exit

    def poll(self, timeout: float) -> list[Event]:
        if not self.events and self.live:
            handles: dict[Any, _Process] = {}
            for worker in self.live.values():
                handles[worker.conn] = worker
                handles[worker.process.sentinel] = worker
            ready = wait(list(handles), timeout)
            for worker in {id(handles[h]): handles[h] for h in ready}.values():
                self._read(worker)  # messages sent before an exit are still in the pipe
                if not worker.reported and not worker.process.is_alive():
                    worker.process.join()
                    self._died(worker, describe_exit(worker.process.exitcode))
        events, self.events = self.events, []
        return events

    def shutdown(self, graceful: bool) -> None:
        workers = list(self.live.values())
        if graceful:
            for worker in workers:
                try:
                    worker.conn.send(("close",))
                except OSError:
                    pass
            for worker in workers:
                worker.process.join(CLOSE_SECONDS)
        for worker in workers + self.retired:
            if worker.process.is_alive():
                worker.process.terminate()
        for worker in workers + self.retired:
            worker.process.join(TERMINATE_SECONDS)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self.live.clear()
        self.retired.clear()


class LocalExecutor:
    """Runs units on worker processes of this host; `placements` from `placement.local_placements`."""

    name = "local"

    def __init__(self, recipe: WorkerRecipe, placements: Sequence[Placement], policy: RetryPolicy = RetryPolicy(),
                 progress_interval: float = 0.5,
                 on_progress: Optional[Callable[[ProgressSnapshot], None]] = None) -> None:
        if not placements:
            raise ValueError("at least one worker placement is needed")
        self.recipe = recipe
        self.placements = list(placements)
        self.policy = policy
        self.progress_interval = progress_interval
        self.on_progress = on_progress
        self.stop_flag = StopFlag()

    def stop(self) -> None:
        """Hand out no more units and terminate the workers (safe from another thread or a handler)."""
        self.stop_flag.set()

    def run(self, units: Sequence[UnitSpec]) -> ExecutionReport:
        transport = _ProcessTransport(self.placements, self.recipe, self.progress_interval)
        devices = [f"gpu {p.env['CUDA_VISIBLE_DEVICES']}" if p.device.startswith("cuda") else p.device
                   for p in self.placements]
        return run_dispatch(transport, units, devices, self.name, self.policy,
                            self.stop_flag, self.on_progress, progress_interval=self.progress_interval)
