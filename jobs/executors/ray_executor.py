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

Progress travels from actors to the driver through a `ray.util.queue.Queue` (an actor of its own,
zero CPUs), at the rate bound of `RateLimitedSink`. Ray is imported only when a run starts: importing
this module, or the package, never imports it, and `executor_problem` reports its absence in one line.
Every node needs batchinfer installed (or a `runtime_env` that ships it) and must see the output folder
and the job's work folder (a shared path, or an object-store URI written through `storage.PartStore`).
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from jobs.executors.contract import ProgressDelta, RateLimitedSink, WorkerRecipe
from jobs.executors.dispatch import (Died, Event, ExecutionReport, Finished, Progress, Ready, RetryPolicy,
                                     StopFlag, run_dispatch)
from jobs.executors.local import describe_exception
from jobs.executors.placement import MEMORY_FRACTION_KEY
from jobs.executors.tally import ProgressSnapshot
from jobs.executors.unit_queue import UnitSpec

RAY_MISSING = "executor: ray needs Ray, which is not installed (pip install 'batchinfer[ray]')"
EXECUTORS = ("local", "ray")
CLOSE_SECONDS = 30.0


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def executor_problem(executor: str) -> Optional[str]:
    """What is wrong with choosing this executor here, in one line; None when it can run."""
    if executor not in EXECUTORS:
        return f"unknown executor {executor!r} (choose local or ray)"
    if executor == "ray" and not ray_available():
        return RAY_MISSING
    return None


class _UnitActor:
    """The actor's body (wrapped by `ray.remote` at run time): builds and drives one UnitWorker."""

    def __init__(self, recipe: WorkerRecipe, worker_index: int, generation: int, device: str, progress_queue: Any,
                 progress_interval: float) -> None:
        self.recipe, self.worker_index, self.device = recipe, worker_index, device
        tag = (worker_index, generation)
        self.sink = RateLimitedSink(lambda unit_id, delta: self._send(progress_queue, (tag, unit_id, delta)),
                                    progress_interval)
        self.worker = None

    @staticmethod
    def _send(queue: Any, item: tuple) -> None:
        try:
            queue.put_nowait(item)
        except Exception:  # progress is best-effort: a lost event never loses work
            pass

    def open(self) -> None:
        self.worker = self.recipe.build()
        self.worker.open(self.worker_index, self.device, self.sink)

    def run_unit(self, unit_id: int) -> Any:
        result = self.worker.run_unit(unit_id)
        self.sink.discard(unit_id)
        return result

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class _RayTransport:
    def __init__(self, ray: Any, recipe: WorkerRecipe, devices: Sequence[str], resources: Mapping[str, float],
                 progress_interval: float) -> None:
        from ray.util.queue import Queue

        self.ray = ray
        self.recipe = recipe
        self.devices = devices
        self.resources = dict(resources)
        self.progress_interval = progress_interval
        self.actor_class = ray.remote(_UnitActor)
        self.queue = Queue(actor_options={"num_cpus": 0})
        self.actors: dict[int, Any] = {}
        self.generation: dict[int, int] = {}
        self.calls: dict[Any, tuple[int, str, Optional[int]]] = {}   # object ref -> (slot, method, unit)

    def start(self, slot: int) -> None:
        generation = self.generation.get(slot, -1) + 1
        self.generation[slot] = generation
        # Ray must not restart or retry on its own: the dispatch loop decides, and counts.
        actor = self.actor_class.options(**self.resources, max_restarts=0, max_task_retries=0).remote(
            self.recipe, slot, generation, self.devices[slot], self.queue, self.progress_interval)
        self.actors[slot] = actor
        self.calls[actor.open.remote()] = (slot, "open", None)

    def assign(self, slot: int, unit_id: int) -> None:
        self.calls[self.actors[slot].run_unit.remote(unit_id)] = (slot, "unit", unit_id)

    def _progress(self) -> list[Event]:
        waiting = self.queue.qsize()
        items = self.queue.get_nowait_batch(waiting) if waiting else []
        return [Progress(slot, unit_id, delta) for (slot, generation), unit_id, delta in items
                if self.generation.get(slot) == generation and slot in self.actors]

    def poll(self, timeout: float) -> list[Event]:
        events = self._progress()
        if not self.calls:
            return events
        ready, _ = self.ray.wait(list(self.calls), num_returns=1, timeout=0 if events else timeout)
        if ready:  # take every call that has finished by now, not just the first
            ready, _ = self.ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
        for ref in ready:
            slot, method, unit_id = self.calls.pop(ref)
            events.extend(self._outcome(ref, slot, method, unit_id))
        return events

    def _outcome(self, ref: Any, slot: int, method: str, unit_id: Optional[int]) -> list[Event]:
        from ray.exceptions import RayActorError, RayTaskError

        where = f" while running unit {unit_id}" if unit_id is not None else " before it was ready"
        try:
            value = self.ray.get(ref)
        except RayActorError as exc:
            return [self._died(slot, unit_id, f"worker {slot} (Ray actor) died{where}: {_first_line(exc)}")]
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            return [self._died(slot, unit_id, f"worker {slot} (Ray actor) raised {describe_exception(cause)}{where}")]
        return [Ready(slot)] if method == "open" else [Finished(slot, value)]

    def _died(self, slot: int, unit_id: Optional[int], reason: str) -> Died:
        actor = self.actors.pop(slot, None)
        if actor is not None:  # an actor that raised may hold a broken device (a sticky CUDA error)
            self.ray.kill(actor, no_restart=True)
        return Died(slot, unit_id, reason)

    def shutdown(self, graceful: bool) -> None:
        if graceful and self.actors:
            closing = [actor.close.remote() for actor in self.actors.values()]
            self.ray.wait(closing, num_returns=len(closing), timeout=CLOSE_SECONDS)
        for actor in self.actors.values():
            self.ray.kill(actor, no_restart=True)
        self.actors.clear()
        self.calls.clear()
        self.queue.shutdown(force=True)


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
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
        if not 0 < gpus_per_worker <= 1:
            raise ValueError("gpus_per_worker must be in (0, 1]")
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

    def _worker_count(self, ray: Any) -> int:
        if self.workers != "auto":
            return int(self.workers)
        if self.device == "cpu":
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
            if self.device == "cuda" and ray.cluster_resources().get("GPU", 0) < self.gpus_per_worker:
                raise RuntimeError("the Ray cluster has no GPU for the CUDA workers")  # else actors wait forever
            workers = self._worker_count(ray)
            recipe = self.recipe
            if self.device == "cuda":
                resources = {"num_cpus": 1, "num_gpus": self.gpus_per_worker}
                if self.gpus_per_worker < 1:  # actors sharing a GPU share its memory too
                    recipe = recipe.with_overrides(**{MEMORY_FRACTION_KEY: self.memory_fraction * self.gpus_per_worker})
                devices = ["cuda:0"] * workers   # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU
            else:
                resources = {"num_cpus": 1}
                devices = ["cpu"] * workers
            transport = _RayTransport(ray, recipe, devices, resources, self.progress_interval)
            return run_dispatch(transport, units, devices, self.name, self.policy, self.stop_flag, self.on_progress,
                                progress_interval=self.progress_interval)
        finally:
            if connected_here:
                ray.shutdown()
