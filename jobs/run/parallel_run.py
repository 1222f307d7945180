"""A job's work units on several engines: worker processes on this host, or actors on a Ray cluster.

    report = run_units_in_workers(job, plan, out_dir, console, unit_ids)   # -> ExecutionReport

The caller (`runner.run_job`) holds the output folder's lock, has built the global plan once and
recorded what earlier runs finished; here the units go to workers largest estimated cost first,
whichever worker has room next (`jobs.executors`). Every worker builds the same
`unit_worker.JobUnitWorker` from the job file and commits its units' parts itself, so nothing
but unit ids and results crosses a process boundary. This process shows the progress of all
workers together (samples, tokens/s, hit rate, ETA) and a per-worker summary; the report's
`stats` is the `executor` section of `_stats.json`.

Where workers run:
- `engine.device: cpu`: N CPU engine processes sharing the cores (threads = cores // N).
- `auto` / `cuda`: one engine per visible GPU (`workers: auto`), or N spread round-robin; engines
  sharing a GPU split `engine.memory_fraction` between them. `cuda:K` pins every engine to GPU K.
- `executor: ray`: one actor per GPU of the cluster (`num_gpus=1`), or N CPU actors without GPUs.
  Every node must see the job file, its inputs and model, and the output folder (with `_work/`) at
  the same paths, i.e. a shared filesystem, since each actor reads the plan and commits its parts
  there itself; and batchinfer must be importable on every node.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence, Union

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from batchinfer.jobs.run.executors.contract import WorkerRecipe
from batchinfer.jobs.run.executors import (ExecutionReport, LocalExecutor, ProgressSnapshot, RayExecutor, RetryPolicy, UnitSpec,
                            available_cores, local_placements, resolve_workers, visible_gpus)
from batchinfer.jobs.global_plan import GlobalPlanSummary, WorkPlan, work_dir_for
from batchinfer.jobs.outdir.interruption import Stopped
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.outdir.part_store import samples_on_disk
from batchinfer.jobs.outdir.progress_time import format_seconds
from batchinfer.jobs.spec.job_file import JobSpec
from batchinfer.jobs.run.unit_worker import WORK_DIR_KEY, job_recipe


@dataclass(frozen=True)
class WorkerLayout:
    """Where a local run's engines go."""

    device: str                 # "cuda" or "cpu"
    gpus: tuple[str, ...]       # CUDA_VISIBLE_DEVICES entries the engines are spread over
    workers: int


def worker_layout(spec: JobSpec, gpus: Optional[Sequence[str]] = None) -> WorkerLayout:
    """The job's engines on this host: `parallel.workers` against `engine.device` and the visible GPUs."""
    gpus = list(visible_gpus() if gpus is None else gpus)
    device = spec.engine.device
    if device == "cpu" or (device == "auto" and not gpus):
        return WorkerLayout("cpu", (), resolve_workers(spec.parallel.workers, "cpu", 0))
    if not gpus:
        raise RuntimeError(f"engine.device is {device}, but no GPU is visible")
    if device.startswith("cuda:"):  # pinned: every engine on that one GPU
        index = int(device.split(":", 1)[1])
        if index >= len(gpus):
            raise RuntimeError(f"engine.device is {device}, but only {len(gpus)} GPU(s) are visible")
        gpus = [gpus[index]]
    # Each engine spans pipeline_stages GPUs (a pinned cuda:K holds all its stages).
    per_engine = 1 if device.startswith("cuda:") else spec.parallel.pipeline_stages
    return WorkerLayout("cuda", tuple(gpus), resolve_workers(spec.parallel.workers, "cuda",
                                                             max(len(gpus) // per_engine, 1)))


def runs_in_workers(spec: JobSpec) -> bool:
    """Whether the job's units go to workers (Ray, or more than one local engine) or run in this process."""
    if spec.parallel.executor == "ray":
        return True
    try:
        return worker_layout(spec).workers > 1
    except RuntimeError:  # no GPU for a cuda device: one engine here says so when it loads, unless N were asked for
        return spec.parallel.workers != "auto" and int(spec.parallel.workers) > 1


class WorkersProgress:
    """All workers' progress as one bar on a terminal, else a plain line every `log_every_seconds`."""

    def __init__(self, console: Console, job_name: str, log_every_seconds: float = 10.0) -> None:
        self.console, self.job_name, self.log_every_seconds = console, job_name, log_every_seconds
        self._last_log = 0.0
        self._bar: Optional[Progress] = None
        self._task = None
        self._last: Optional[ProgressSnapshot] = None

    def __enter__(self) -> "WorkersProgress":
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn(f"[bold]{self.job_name}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>8.1f} tok/s"), TextColumn("hit {task.fields[hit]:>6.1%}"),
                TextColumn("{task.fields[busy]}"), TextColumn("eta"), TimeRemainingColumn(),
                console=self.console, transient=False)
            self._task = self._bar.add_task(self.job_name, total=None, rate=0.0, hit=0.0, busy="")
            self._bar.start()
        return self

    def __call__(self, snap: ProgressSnapshot) -> None:
        self._last = snap
        if self._bar is not None:
            self._bar.update(self._task, completed=snap.samples_done, total=snap.samples_total or None,
                             rate=snap.output_tokens_per_second, hit=snap.hit_rate, busy=self._busy(snap))
        elif time.monotonic() - self._last_log >= self.log_every_seconds:
            self._log(snap)

    @staticmethod
    def _busy(snap: ProgressSnapshot) -> str:
        return f"units {snap.units_finished}/{snap.units_total}, {snap.workers_busy} busy"

    def _log(self, snap: ProgressSnapshot) -> None:
        self._last_log = time.monotonic()
        eta = format_seconds(snap.eta_seconds)
        self.console.print(
            f"[{self.job_name}] {snap.samples_done}/{snap.samples_total} samples  "
            f"{snap.output_tokens_per_second:.1f} tok/s  hit {snap.hit_rate:.1%}  {self._busy(snap)}  "
            f"elapsed {format_seconds(snap.elapsed_seconds)}  eta {eta}", highlight=False, markup=False)

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self._last is not None:
            self._log(self._last)


def render_workers(console: Console, stats: dict) -> None:
    """The per-worker table printed after a parallel run."""
    table = Table(title=f"{stats['executor']} executor: {stats['workers']} workers, {stats['units_finished']}/"
                        f"{stats['units']} units", title_justify="left")
    for column in ("worker", "device", "units", "samples", "load s", "busy s", "idle tail s", "restarts"):
        table.add_column(column, justify="left" if column == "device" else "right")
    for worker in stats["per_worker"]:
        table.add_row(str(worker["worker"]), worker["device"], f"{worker['units']:,}", f"{worker['samples']:,}",
                      f"{worker['load_seconds']:.1f}", f"{worker['busy_seconds']:.1f}",
                      f"{worker['idle_tail_seconds']:.1f}", str(worker["restarts"]))
    console.print(table)
    for worker in stats["per_worker"]:
        for failure in worker["failures"]:
            console.print(f"worker {worker['worker']}: {failure}", highlight=False, markup=False)


Executor = Union[LocalExecutor, RayExecutor]


def make_executor(job: PreparedJob, plan: WorkPlan, policy: RetryPolicy,
                  on_progress: Callable[[ProgressSnapshot], None], recipe: Optional[WorkerRecipe] = None) -> Executor:
    """The job's executor: worker processes here, or actors on the Ray cluster at `parallel.ray_address`.
    `recipe`: how workers build themselves (default `job_recipe`; a test supplies its own to inject faults)."""
    spec = job.spec
    recipe = recipe if recipe is not None else job_recipe(spec)
    if Path(plan.work_dir) != work_dir_for(spec.output.path):
        recipe = replace(recipe, overrides={**recipe.overrides, WORK_DIR_KEY: str(plan.work_dir)})
    if spec.parallel.executor == "ray":
        device = "cpu" if spec.engine.device == "cpu" else "cuda" if spec.engine.device.startswith("cuda") else "auto"
        return RayExecutor(recipe, workers=spec.parallel.workers, device=device, address=spec.parallel.ray_address,
                           gpus_per_worker=spec.parallel.pipeline_stages,  # a Ray worker is one pipeline on one host
                           memory_fraction=spec.engine.memory_fraction, policy=policy, on_progress=on_progress)
    layout = worker_layout(spec)
    stages = 1 if spec.engine.device.startswith("cuda:") else spec.parallel.pipeline_stages
    placements = local_placements(layout.workers, layout.device, layout.gpus, cores=available_cores(),
                                  memory_fraction=spec.engine.memory_fraction, gpus_per_worker=stages)
    return LocalExecutor(recipe, placements, policy, on_progress=on_progress)


def run_units_in_workers(job: PreparedJob, plan: WorkPlan, out_dir: Path, console: Console,
                         unit_ids: Optional[Sequence[int]] = None, policy: RetryPolicy = RetryPolicy(),
                         recipe: Optional[WorkerRecipe] = None) -> ExecutionReport:
    """Run the units (`unit_ids`, default every unit of the plan) on the job's workers; → the report.

    The report's status is done, failed (its `failure` names the unit or the workers' reasons:
    the caller raises JobRuntimeError, parts kept) or interrupted (`raise_interruption`)."""
    if Path(out_dir) != job.spec.output.path:
        raise ValueError(f"workers commit into the job's output folder {job.spec.output.path}, not {out_dir}")
    ids = [unit.unit_id for unit in plan.iter_units_by_cost()] if unit_ids is None else list(unit_ids)
    units = [UnitSpec(unit_id, cost=plan.unit(unit_id).cost, samples=plan.unit(unit_id).samples)
             for unit_id in ids]
    progress = WorkersProgress(console, job.spec.name)
    executor = make_executor(job, plan, policy, progress, recipe)
    with progress:
        report = executor.run(units)
    render_workers(console, report.stats)
    return report


def raise_interruption(report: ExecutionReport) -> None:
    """Stop as the in-process run stops for the signal that interrupted the workers
    (`jobs.outdir.interruption`): through the handler the caller installed (the CLI's raises Stopped,
    exit 128 + the signal's number), else as Stopped, or KeyboardInterrupt for SIGINT."""
    sig = report.interrupted_by
    if sig is not None and callable(signal.getsignal(sig)):
        signal.raise_signal(sig)  # the handler raises; returns if it does not
    if sig is not None and sig != signal.SIGINT:
        raise Stopped(sig)
    raise KeyboardInterrupt()


def summed_counters(results: Any) -> Optional[SimpleNamespace]:
    """Engine counters of a parallel run's unit results, as `build_stats` reads them (peaks: the max)."""
    totals: dict[str, float] = {}
    for result in results:
        for name, value in result.counters.items():
            totals[name] = max(totals.get(name, 0), value) if name.startswith("peak_") else \
                totals.get(name, 0) + value
    return SimpleNamespace(**totals) if totals else None


class WorkersExecutor:
    """The job's units on workers (`run_units`: `run_units_in_workers`, or a test's own), as the runner
    drives every executor (`job_executor.JobExecutor`); what they committed is counted from the records
    on disk, since the workers commit their own parts."""

    def __init__(self, run_units: Callable[..., ExecutionReport] = run_units_in_workers) -> None:
        self._run_units = run_units
        self._out_dir: Optional[Path] = None
        self._baseline = 0
        self.report: Optional[ExecutionReport] = None

    def start(self, job: PreparedJob) -> None:
        pass  # each worker loads its own engine once it is handed units

    def planned(self, summary: GlobalPlanSummary) -> None:
        pass

    def ready(self) -> dict[str, float]:
        return {}

    def run(self, job: PreparedJob, planned: Any, out_dir: Path, console: Console,
            unit_ids: list[int]) -> ExecutionReport:
        self._out_dir, self._baseline = out_dir, samples_on_disk(out_dir)[0]
        self.report = self._run_units(job, planned.plan, out_dir, console, unit_ids=unit_ids)
        return self.report

    def flush_partial(self) -> None:
        pass  # a worker commits what it finished before it stops

    @property
    def samples_written(self) -> int:
        return samples_on_disk(self._out_dir)[0] - self._baseline if self._out_dir is not None else 0

    @property
    def errors_written(self) -> int:
        results = getattr(self.report, "results", {}) or {}
        return sum(result.errors for result in results.values())

    def engine_stats(self) -> Any:
        return summed_counters(getattr(self.report, "results", {}).values()) if self.report is not None else None

    def settings(self) -> Optional[dict]:
        return None
