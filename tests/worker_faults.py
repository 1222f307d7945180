"""Fault injection for the parallel run's tests, through the worker recipe (nothing of it in the product).

    executor = fault_executor("kill_self", after=3, marker=tmp_path / "killed")
    run_job(job, console, executor=executor)

Every worker is the real `JobUnitWorker`, built by `build_faulty_worker`; the first worker (over all
processes) that has finished `after` samples and creates `marker` SIGKILLs itself (a worker dying
mid-job) or sends its parent SIGTERM (a run stopped while units are half done).
"""
from __future__ import annotations

import os
import signal
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from batchinfer.jobs.run.executors.contract import ProgressSink, WorkerRecipe
from batchinfer.jobs.run.parallel_run import run_units_in_workers
from batchinfer.jobs.run.unit_worker import JobUnitWorker, job_recipe

FAULT_KEY = "test_fault"   # not dotted: the worker's own override, not a job key


class SignalAfter:
    """A progress wrapper that sends one signal after the worker's `after`-th sample."""

    def __init__(self, inner: Any, after: int, marker: str, pid: int, signum: int) -> None:
        self.inner, self.after, self.marker, self.pid, self.signum = inner, after, marker, pid, signum
        self.seen = 0

    def sample_done(self, unit_id: int, result: Any) -> None:
        self.inner.sample_done(unit_id, result)
        self.seen += 1
        if self.seen == self.after:
            try:  # O_EXCL: exactly one worker over all processes signals
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            os.kill(self.pid, self.signum)


class FaultyJobWorker(JobUnitWorker):
    def open(self, worker_index: int, device: str, progress: ProgressSink) -> None:
        super().open(worker_index, device, progress)
        kind, after, marker = self.recipe.overrides[FAULT_KEY]
        pid, signum = (os.getpid(), signal.SIGKILL) if kind == "kill_self" else (os.getppid(), signal.SIGTERM)
        self.runner.progress = SignalAfter(self.runner.progress, after, marker, pid, signum)


def build_faulty_worker(recipe: WorkerRecipe) -> FaultyJobWorker:
    return FaultyJobWorker(recipe)


def _run_with_fault(fault: tuple, job: Any, plan: Any, out_dir: Path, console: Any, unit_ids=None):
    recipe = job_recipe(job.spec, {FAULT_KEY: fault})
    recipe = replace(recipe, factory=f"{__name__}:build_faulty_worker")
    return run_units_in_workers(job, plan, out_dir, console, unit_ids=unit_ids, recipe=recipe)


def fault_executor(kind: str, after: int, marker: Path):
    """`run_job(..., executor=...)`: the job's workers, one of which signals (`kind`: kill_self | stop_parent)."""
    assert kind in ("kill_self", "stop_parent")
    return partial(_run_with_fault, (kind, after, str(marker)))
