"""The real `UnitWorker`: one engine in a worker process (or Ray actor) running a job's work units.

    recipe = job_recipe(job)   # picklable: the job file, the job's name, overrides
    # in the worker: build_job_worker(recipe).open(index, "cuda:0", sink); .run_units(ids) / .run_unit(id)

`open` re-reads the job from its file (as the parent read it; `prepare_job` with overwrite
semantics, so the folder the parent is running into is never a reason to refuse), applies the
recipe's overrides (the worker's device, a shared GPU's share of the memory), loads the engine
once and opens the parent's committed work plan read-only. Units then run through
`unit_runner.UnitRunner`, which commits every unit's parts under names fixed by the unit: a unit
run again after a crash skips what was committed and rewrites nothing.
"""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from batchinfer.jobs.run.executors.contract import ProgressSink, UnitResult, WorkerRecipe
from batchinfer.jobs.run.executors.worker_loop import StopRequested, parent_alive
from batchinfer.jobs.global_plan import open_work_plan, work_dir_for
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.run.global_run import plan_row_tokens
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.spec.job_file import JobSpec, load_job_file
from batchinfer.jobs.run.unit_runner import SinkProgress, UnitRunner

FACTORY = "batchinfer.jobs.run.unit_worker:build_job_worker"
DEVICE_KEY = "engine.device"
WORK_DIR_KEY = "work_dir"          # not a job key: where the parent's work plan is, when not <output>/_work


def job_recipe(spec: JobSpec, overrides: Optional[Mapping[str, Any]] = None) -> WorkerRecipe:
    """How a worker rebuilds this job: the job file by absolute path (a worker's folder may differ)."""
    return WorkerRecipe(factory=FACTORY, job_file=str(Path(spec.job_file).resolve()), job_name=spec.name,
                        overrides=dict(overrides or {}))


def apply_overrides(spec: JobSpec, overrides: Mapping[str, Any]) -> JobSpec:
    """Dotted job keys ("engine.memory_fraction": 0.45) set on the spec; other keys are the worker's own."""
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if not name:
            continue
        block = getattr(spec, section, None)
        if block is None or name not in {f.name for f in fields(block)}:
            raise ValueError(f"override {key!r} is not a job key")
        spec = replace(spec, **{section: replace(block, **{name: value})})
    return spec


class JobUnitWorker:
    """`jobs.executors.contract.UnitWorker` over a real job: load once, run units, commit their parts."""

    def __init__(self, recipe: WorkerRecipe) -> None:
        self.recipe = recipe
        self.runner: Optional[UnitRunner] = None
        self.job: Optional[PreparedJob] = None

    def open(self, worker_index: int, device: str, progress: ProgressSink) -> None:
        from batchinfer.jobs.run.runner import open_engine  # the runner imports the parallel path: import it late

        recipe = self.recipe
        if recipe.job_file is None or recipe.job_name is None:
            raise ValueError("a job worker needs the job file and the job's name")
        (spec,) = load_job_file(Path(recipe.job_file)).select(recipe.job_name)
        spec = apply_overrides(spec, {DEVICE_KEY: device, **recipe.overrides})
        self.job = prepare_job(spec, overwrite=True)
        work_dir = Path(recipe.overrides.get(WORK_DIR_KEY) or work_dir_for(spec.output.path))
        plan = open_work_plan(work_dir)
        # Sized by the plan's row figure, as the in-process engine is (max_running set by hand still wins).
        engine = open_engine(self.job, row_tokens=plan_row_tokens(plan.summary))
        # A local worker process commits nothing once the run that started it is gone (its lock is stale).
        self.runner = UnitRunner(self.job, engine, plan, spec.output.path, SinkProgress(progress),
                                 before_commit=parent_alive)

    def run_units(self, unit_ids: Iterator[int]) -> Iterator[UnitResult]:
        """Units through one engine call, pulled as the engine has room (it overlaps consecutive units).

        When the parent ends the run (StopRequested), the samples finished in open chunks are
        committed first: no attempt at these units follows in this run, and the next run retires
        such parts before it redoes their chunks. A worker that fails on its own commits nothing
        partial, since its units run again in this run."""
        assert self.runner is not None, "open() first"
        try:
            yield from self.runner.run_units(unit_ids)
        except StopRequested:
            self.runner.flush_partial()
            raise

    def run_unit(self, unit_id: int) -> UnitResult:
        (result,) = list(self.run_units(iter([unit_id])))
        return result

    def close(self) -> None:
        self.runner = None  # the engine and its device memory go with the process


def build_job_worker(recipe: WorkerRecipe) -> JobUnitWorker:
    return JobUnitWorker(recipe)
