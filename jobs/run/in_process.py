"""The in-process executor: every unit through one engine in this process (`job_executor.JobExecutor`).

The engine builds in a background thread while the job plans (`EngineBuild`), sized by the plan's
row figure once it is known; the units then go to it through `unit_runner.UnitRunner`, whose parts
are committed as their chunks finish, with the run's progress bar.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console

from batchinfer.engine.engine_build import EngineBuild
from batchinfer.jobs.global_plan import GlobalPlanSummary
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.outdir.unit_parts import DoneIndex
from batchinfer.jobs.run.global_run import PlannedUnits, plan_row_tokens
from batchinfer.jobs.run.unit_runner import UnitRunner


@dataclass(frozen=True)
class InProcessReport:
    status: str = "done"  # a failure or a stop signal raises instead
    failure: Optional[str] = None
    stats: Optional[dict] = None  # one engine here: no executor section


class InProcessExecutor:
    def __init__(self, engine_factory: Callable[[PreparedJob, int], Any], window_rows: int, progress: Any,
                 before_commit: Callable[[], None]) -> None:
        self.engine_factory, self.window_rows = engine_factory, window_rows
        self.progress, self.before_commit = progress, before_commit
        self.engine: Any = None
        self._build: Optional[EngineBuild] = None
        self._runner: Optional[UnitRunner] = None

    def start(self, job: PreparedJob) -> None:
        self._build = EngineBuild.start(partial(self.engine_factory, job, self.window_rows))

    def planned(self, summary: GlobalPlanSummary) -> None:
        assert self._build is not None
        self._build.post_row_tokens(plan_row_tokens(summary))

    def ready(self) -> dict[str, float]:
        if self.engine is None:
            assert self._build is not None
            self.engine = self._build.result()
        return dict(getattr(self.engine, "startup_seconds", {}))

    def run(self, job: PreparedJob, planned: PlannedUnits, out_dir: Path, console: Console,
            unit_ids: list[int]) -> InProcessReport:
        self._runner = UnitRunner(job, self.engine, planned.plan, out_dir, self.progress,
                                  before_commit=self.before_commit, inputs=planned.inputs,
                                  done=DoneIndex(planned.plan.work_dir))
        with self.progress:
            for _ in self._runner.run_units(unit_ids):
                pass
        return InProcessReport()

    def flush_partial(self) -> None:
        """Commit what the open chunks hold (`UnitRunner.flush_partial`)."""
        if self._runner is not None:
            self._runner.flush_partial()

    @property
    def samples_written(self) -> int:
        return self._runner.samples_committed if self._runner is not None else 0

    @property
    def errors_written(self) -> int:
        return self._runner.errors_committed if self._runner is not None else 0

    def engine_stats(self) -> Any:
        return getattr(self.engine, "stats", None)

    def settings(self) -> Optional[dict]:
        settings = getattr(self.engine, "settings", None)
        return settings() if callable(settings) else None
