"""RayExecutor: one actor per GPU (or one CPU actor per worker) on a Ray cluster, with our own queue.

Why Ray Core actors and not Ray Data (`map_batches` over an `ActorPoolStrategy`, one unit per block):
- what matters here is ours whichever we pick: the exactly-once commit (part names fixed by the
  unit), handing a dead actor's unit to another actor, the per-unit retry limit that ends the job
  naming a unit which kills every worker it touches, and per-worker statistics (busy seconds, idle
  tail). Ray Data exposes none of these per actor, and its retries end in failing the whole dataset;
- our units are already balanced by estimated cost, and we want the largest pending unit on
  whichever actor frees up first. Ray Data's streaming executor decides itself which block goes to
  which actor and queues several blocks per actor, i.e. it reintroduces the static shares we avoid;
- the outputs are ours too (the worker commits each unit under its fixed names), so Ray Data's
  readers and writers would sit unused, while it would add `ray[data]` (pandas, its own Arrow
  plumbing) to an optional extra that today needs only the `ray` wheel;
- with actors the Ray executor is the local one with another transport: the same dispatch loop
  (`dispatch.run_dispatch`), the same worker code, the same tests.

Each actor runs the worker loop of `worker_loop.py` (the one worker processes run) on a thread; the
driver sends it messages by method call and collects its messages (readiness, requests for work,
results, progress at the rate bound of `RateLimitedSink`) with one outstanding `events` call per
actor; a lost actor shows as that call failing. Ray is imported only when a run starts: importing
this module, or the package, never imports it, and `executor_problem` reports its absence in one line.
Every node needs batchinfer installed (or a `runtime_env` that ships it) and must see the output folder
and the job's work folder (a shared path).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from batchinfer.jobs.run.executors.contract import WorkerRecipe
from batchinfer.jobs.run.executors.dispatch import (Died, Event, ExecutionReport, Finished, Progress, Ready, RetryPolicy,
                                     StopFlag, Want, run_dispatch)
from batchinfer.jobs.run.executors.local import describe_units
from batchinfer.jobs.run.executors.worker_loop import serve
from batchinfer.jobs.run.executors.placement import MEMORY_FRACTION_KEY
from batchinfer.jobs.run.executors.tally import ProgressSnapshot
from batchinfer.jobs.run.executors.unit_queue import UnitSpec
from batchinfer.jobs.spec.executors import executor_problem

CLOSE_SECONDS = 30.0
EVENTS_WAIT_SECONDS = 0.5   # an `events` call returns at the first message, or empty after this long
_EVENTS_GROUP = "events"


class _UnitActor:
    """The actor's body (wrapped by `ray.remote` at run time): the shared worker loop on a thread of its own.

    Messages reach the loop through an inbox (`send`, in call order: the default concurrency group runs one
    call at a time); its messages wait in an outbox that the driver collects with `events`, which runs in
    a group of its own so that a waiting `events` call never holds up `send`.
    """

    def __init__(self, recipe: WorkerRecipe, worker_index: int, device: str, progress_interval: float) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, args=(recipe, worker_index, device, progress_interval),
                                       name="batchinfer-unit-worker", daemon=True)
        self.thread.start()

    def _serve(self, recipe: WorkerRecipe, worker_index: int, device: str, progress_interval: float) -> None:
        try:
            serve(recipe, worker_index, device, self.inbox.get, self.outbox.put, progress_interval)
        except BaseException:  # noqa: BLE001 - already in the outbox as ("failed", reason)
            pass

    def send(self, message: tuple) -> None:
        self.inbox.put(message)

    def events(self, timeout: float) -> list[tuple]:
        """What the loop said since the last call; waits up to `timeout` seconds for the first message."""
        try:
            items = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self.outbox.get_nowait())
            except queue.Empty:
                return items

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


@dataclass
class _Actor:
    handle: Any
    generation: int
    units: set[int] = field(default_factory=set)   # assigned and not finished
    ready: bool = False


class _RayTransport:
    def __init__(self, ray: Any, recipe: WorkerRecipe, devices: Sequence[str], resources: Mapping[str, float],
                 progress_interval: float) -> None:
        self.ray = ray
        self.recipe = recipe
        self.devices = devices
        self.resources = dict(resources)
        self.progress_interval = progress_interval
        self.actor_class = ray.remote(concurrency_groups={_EVENTS_GROUP: 1})(_UnitActor)
        self.actors: dict[int, _Actor] = {}
        self.generation: dict[int, int] = {}
        self.calls: dict[Any, tuple[int, int]] = {}   # outstanding `events` call -> (slot, generation)

    def start(self, slot: int) -> None:
        generation = self.generation.get(slot, -1) + 1
        self.generation[slot] = generation
        # Ray must not restart or retry on its own: the dispatch loop decides, and counts.
        handle = self.actor_class.options(**self.resources, max_restarts=0, max_task_retries=0).remote(
            self.recipe, slot, self.devices[slot], self.progress_interval)
        self.actors[slot] = _Actor(handle, generation)
        self._collect(slot)

    def _collect(self, slot: int) -> None:
        actor = self.actors[slot]
        ref = actor.handle.events.options(concurrency_group=_EVENTS_GROUP).remote(EVENTS_WAIT_SECONDS)
        self.calls[ref] = (slot, actor.generation)

    def assign(self, slot: int, unit_id: int) -> None:
        actor = self.actors[slot]
        actor.units.add(unit_id)
        actor.handle.send.remote(("unit", unit_id))

    def drain(self, slot: int) -> None:
        self.actors[slot].handle.send.remote(("drain",))

    def poll(self, timeout: float) -> list[Event]:
        if not self.calls:
            return []
        ready, _ = self.ray.wait(list(self.calls), num_returns=1, timeout=timeout)
        if ready:  # take every call that has returned by now, not just the first
            ready, _ = self.ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
        events: list[Event] = []
        for ref in ready:
            slot, generation = self.calls.pop(ref)
            actor = self.actors.get(slot)
            if actor is None or actor.generation != generation:
                continue  # an earlier actor of a restarted slot
            events.extend(self._outcome(ref, slot, actor))
            if slot in self.actors:
                self._collect(slot)
        return events

    def _outcome(self, ref: Any, slot: int, actor: _Actor) -> list[Event]:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            messages = self.ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            return [self._died(slot, actor, f"died{describe_units(actor.units, actor.ready)}: {_first_line(exc)}")]
        events: list[Event] = []
        for message in messages:
            kind = message[0]
            if kind == "ready":
                actor.ready = True
                events.append(Ready(slot))
            elif kind == "want":
                events.append(Want(slot))
            elif kind == "progress":
                events.append(Progress(slot, message[1], message[2]))
            elif kind == "done":
                actor.units.discard(message[1].unit_id)
                events.append(Finished(slot, message[1]))
            elif kind == "failed":
                events.append(self._died(slot, actor, f"raised {message[1]}{describe_units(actor.units, actor.ready)}"))
                break
        return events

    def _died(self, slot: int, actor: _Actor, what: str) -> Died:
        del self.actors[slot]
        # An actor whose worker raised may hold a broken device (a sticky CUDA error): never reuse it.
        self.ray.kill(actor.handle, no_restart=True)
        return Died(slot, f"worker {slot} (Ray actor) {what}")

    def shutdown(self, graceful: bool) -> None:
        if graceful and self.actors:
            for actor in self.actors.values():
                actor.handle.send.remote(("close",))
            closing = [actor.handle.join.remote(CLOSE_SECONDS) for actor in self.actors.values()]
            self.ray.wait(closing, num_returns=len(closing), timeout=CLOSE_SECONDS)
        for actor in self.actors.values():
            self.ray.kill(actor.handle, no_restart=True)
        self.actors.clear()
        self.calls.clear()


def _check_fits(cluster: Mapping[str, float], resources: Mapping[str, float], workers: int) -> None:
    """Actors the cluster cannot hold would wait forever: refuse at once, naming what is missing."""
    names = {"num_cpus": "CPU", "num_gpus": "GPU"}
    for key, each in sorted(resources.items(), key=lambda item: item[0] != "num_gpus"):  # GPUs first
        have, need = cluster.get(names[key], 0.0), each * workers
        if need > have:
            raise RuntimeError(f"{workers} Ray workers need {need:g} {names[key]}s, the cluster has {have:g}")


def actor_device(gpus_per_worker: float) -> str:
    """The engine device inside a CUDA actor: Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs, so
    one GPU (or a share) is cuda:0, and an engine of N pipeline stages spans cuda:0..N-1 as `cuda`."""
    return "cuda" if gpus_per_worker > 1 else "cuda:0"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


class RayExecutor:
    """Runs units on Ray actors; `address` goes to `ray.init(address=...)` as given (auto, local, ray://...).

    When Ray is already initialised in this process (a test, a notebook), that session is used and left
    running; otherwise the executor connects (or starts a local cluster) and disconnects at the end.
    """

    name = "ray"

    def __init__(self, recipe: WorkerRecipe, workers: Union[int, str], device: str = "cpu",
                 address: Optional[str] = "auto", gpus_per_worker: float = 1.0, memory_fraction: float = 0.9,
                 policy: RetryPolicy = RetryPolicy(), progress_interval: float = 0.5,
                 on_progress: Optional[Callable[[ProgressSnapshot], None]] = None,
                 runtime_env: Optional[dict[str, Any]] = None) -> None:
        if device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be 'cuda', 'cpu' or 'auto' (cuda where the cluster has GPUs), "
                             f"not {device!r}")
        if not (0 < gpus_per_worker <= 1 or float(gpus_per_worker).is_integer()):
            raise ValueError("gpus_per_worker must be in (0, 1], or a whole number (an engine of pipeline stages)")
        self.recipe = recipe
        self.workers = workers
        self.device = device
        self.address = address
        self.gpus_per_worker = gpus_per_worker
        self.memory_fraction = memory_fraction
        self.policy = policy
        self.progress_interval = progress_interval
        self.on_progress = on_progress
        self.runtime_env = runtime_env
        self.stop_flag = StopFlag()

    def stop(self) -> None:
        self.stop_flag.set()

    def _worker_count(self, ray: Any, device: str) -> int:
        if self.workers != "auto":
            return int(self.workers)
        if device == "cpu":
            return 1
        return int(ray.cluster_resources().get("GPU", 0) / self.gpus_per_worker)

    def run(self, units: Sequence[UnitSpec]) -> ExecutionReport:
        problem = executor_problem("ray")
        if problem is not None:
            raise RuntimeError(problem)
        import ray

        connected_here = not ray.is_initialized()
        if connected_here:
            ray.init(address=self.address, runtime_env=self.runtime_env, log_to_driver=True)
        try:
            has_gpu = ray.cluster_resources().get("GPU", 0) >= self.gpus_per_worker
            device = ("cuda" if has_gpu else "cpu") if self.device == "auto" else self.device
            if device == "cuda" and not has_gpu:
                raise RuntimeError("the Ray cluster has no GPU for the CUDA workers")  # else actors wait forever
            workers = self._worker_count(ray, device)
            recipe = self.recipe
            if device == "cuda":
                resources = {"num_cpus": 1, "num_gpus": self.gpus_per_worker}
                if self.gpus_per_worker < 1:  # actors sharing a GPU share its memory too
                    recipe = recipe.with_overrides(**{MEMORY_FRACTION_KEY: self.memory_fraction * self.gpus_per_worker})
                devices = [actor_device(self.gpus_per_worker)] * workers
            else:
                resources = {"num_cpus": 1}
                devices = ["cpu"] * workers
            _check_fits(ray.cluster_resources(), resources, workers)
            transport = _RayTransport(ray, recipe, devices, resources, self.progress_interval)
            return run_dispatch(transport, units, devices, self.name, self.policy, self.stop_flag, self.on_progress,
                                progress_interval=self.progress_interval)
        finally:
            if connected_here:
                ray.shutdown()
