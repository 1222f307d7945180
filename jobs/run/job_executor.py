"""What runs a planned job's units: one protocol for this process, local workers and Ray.

    executor = job_executor(job, options.executor, engine_factory, window_rows, progress, lock.ensure_held)
    executor.start(job)                    # before planning: what may overlap it (the engine build)
    planned = plan_units(...)
    executor.planned(planned.plan.summary) # the plan's figures (they size the engine)
    startup = executor.ready()             # the engine built; raises what the build raised
    report = executor.run(job, planned, out_dir, console, unit_ids)   # parts committed as units finish

`in_process.InProcessExecutor` runs the units through one engine here; `parallel_run.WorkersExecutor`
hands them to the job's workers (local processes or Ray actors), each committing its own parts.
The runner drives either the same way and reads the same figures back for `_stats.json`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from rich.console import Console

from batchinfer.jobs.global_plan import GlobalPlanSummary
from batchinfer.jobs.inputs.prepared_job import PreparedJob


class RunReport(Protocol):
    status: str                  # done | failed | interrupted
    failure: Optional[str]       # failed: one line naming the unit or the workers' reasons
    stats: Optional[dict]        # the `executor` section of _stats.json (None: one engine here)


class JobExecutor(Protocol):
    def start(self, job: PreparedJob) -> None:
        """Before planning: begin what may overlap it."""

    def planned(self, summary: GlobalPlanSummary) -> None:
        """The plan is made: its figures (the engine's row size)."""

    def ready(self) -> dict[str, float]:
        """Wait until units can run (also after a failed plan); → startup seconds by phase. Raises what
        `start` began and failed (a model that cannot load)."""

    def run(self, job: PreparedJob, planned: Any, out_dir: Path, console: Console, unit_ids: list[int]) -> RunReport:
        """Run the units (`global_run.PlannedUnits`), each unit's parts committed as its chunks finish."""

    def flush_partial(self) -> None:
        """The run stops early: commit every finished sample not yet in a part."""

    @property
    def samples_written(self) -> int: ...

    @property
    def errors_written(self) -> int: ...

    def engine_stats(self) -> Any:
        """Engine counters as `build_stats` reads them (None: no engine ran)."""

    def settings(self) -> Optional[dict]:
        """The engine's settings for `_stats.json` (None: from the job's spec)."""


# A parallel run of units: (job, plan, output folder, console, unit_ids=...) → jobs.executors.ExecutionReport
UnitExecutor = Callable[..., Any]


def job_executor(job: PreparedJob, units_elsewhere: Optional[UnitExecutor], engine_factory: Callable[..., Any],
                 window_rows: int, progress: Any, before_commit: Callable[[], None]) -> JobExecutor:
    """The job's executor: `units_elsewhere` when given, the job's workers when its `parallel` settings
    resolve to more than one engine or to Ray, else one engine in this process."""
    from batchinfer.jobs.run.parallel_run import WorkersExecutor, run_units_in_workers, runs_in_workers

    if units_elsewhere is not None:
        return WorkersExecutor(units_elsewhere)
    if runs_in_workers(job.spec):
        return WorkersExecutor(run_units_in_workers)
    from batchinfer.jobs.run.in_process import InProcessExecutor

    return InProcessExecutor(engine_factory, window_rows, progress, before_commit)
