"""`batchinfer run jobs.yaml`, `batchinfer plan jobs.yaml` and `batchinfer warmup jobs.yaml`.

Exit codes: 0 done; 2 bad input (one line `error: <file>: <key/column>: <what>`, nothing
written), an output folder in use by another run among them; 1 a runtime failure, a full disk
among them (finished parts stay on disk, a rerun resumes); 130 Ctrl-C (SIGINT), 143 SIGTERM and
129 SIGHUP (128 + the signal's number; `jobs.outdir.interruption`), each after writing every finished
sample and `_stats.json` (status interrupted). A closed stdout (`| head`) or hung-up terminal
only silences the progress (`jobs.quiet_streams`). Every job in the file is checked, and its
output folder locked, before the first one runs, so a mistake in the last job does not leave the
first one half done.
"""
from __future__ import annotations

import signal
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import NoReturn, Optional

import click
from rich.console import Console

from batchinfer import __version__
from batchinfer.jobs.errors import JobError, JobRuntimeError, no_space_line
from batchinfer.jobs.outdir.interruption import Stopped, signal_name, stop_on_signals, stop_signal_of
from batchinfer.jobs.outdir.lock import OutputLock
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.quiet_streams import quiet_when_closed
from batchinfer.jobs.run.runner import lock_output, run_job
from batchinfer.jobs.spec.job_file import load_job_file

EXIT_RUNTIME_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_SIGNAL_BASE = 128   # a stop signal exits 128 + its number: 130 SIGINT, 143 SIGTERM, 129 SIGHUP


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _stopped_line(signum: int) -> str:
    what = "interrupted" if signum == signal.SIGINT else f"terminated by {signal_name(signum)}"
    return f"{what} (finished parts are kept; rerun to resume)"


def _prepare_all(job_file: Path, job_name: Optional[str], overwrite: bool,
                 workers: Optional[int] = None, stages: Optional[int] = None) -> list[PreparedJob]:
    """Every selected job checked; `workers` (run --workers N) replaces each job's parallel.workers,
    `stages` (--pipeline-stages N) its parallel.pipeline_stages."""
    try:
        specs = load_job_file(job_file).select(job_name)
        if workers is not None:
            specs = tuple(replace(spec, parallel=replace(spec.parallel, workers=workers)) for spec in specs)
        if stages is not None:
            specs = tuple(replace(spec, parallel=replace(spec.parallel, pipeline_stages=stages)) for spec in specs)
        return [prepare_job(spec, overwrite) for spec in specs]
    except JobError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    except OSError as exc:  # unreadable files, permissions: still the user's input; a full disk is not
        if no_space_line(exc) is not None:
            raise
        _fail(f"{job_file}: {exc}", EXIT_BAD_INPUT)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="batchinfer")
def main() -> None:
    """Offline batch inference for GDN-hybrid language models."""


@main.command()
@click.argument("job_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--job", "job_name", default=None, help="Run only the job with this name.")
@click.option("--overwrite", is_flag=True, help="Delete earlier outputs of the job(s) instead of resuming.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Engines to run each job on (overrides the job's parallel.workers).")
@click.option("--pipeline-stages", "stages", type=click.IntRange(min=1), default=None,
              help="GPUs each engine's layers are split over (overrides the job's parallel.pipeline_stages).")
def run(job_file: Path, job_name: Optional[str], overwrite: bool, workers: Optional[int],
        stages: Optional[int]) -> None:
    """Run the jobs of JOB_FILE (resuming where an earlier run stopped)."""
    current: Optional[PreparedJob] = None
    with quiet_when_closed(), stop_on_signals():
        try:
            prepared = _prepare_all(job_file, job_name, overwrite, workers, stages)
            console = Console()
            with ExitStack() as held:
                locks = _lock_all(prepared, held)
                for current in prepared:
                    try:
                        run_job(current, console, overwrite=overwrite, lock=locks[current.spec.output.path],
                                warn=lambda message: click.echo(f"warning: {message}", err=True))
                    except JobError as exc:
                        _fail(str(exc), EXIT_BAD_INPUT)
                    except JobRuntimeError as exc:
                        line = no_space_line(exc, current.spec.output.path)
                        _fail(f"job {exc.job_name}: {line}" if line else
                              f"{exc} (finished parts are kept; rerun to resume)", EXIT_RUNTIME_FAILURE)
        except (KeyboardInterrupt, Stopped) as exc:
            signum = stop_signal_of(exc) or signal.SIGINT
            _fail(f"{_job_label(current)}{_stopped_line(signum)}", EXIT_SIGNAL_BASE + signum)
        except OSError as exc:  # a full disk outside a job's own handling (its lock, its plan, its stats)
            line = no_space_line(exc, current.spec.output.path if current is not None else None)
            if line is None:
                raise
            _fail(f"{_job_label(current)}{line}", EXIT_RUNTIME_FAILURE)


def _job_label(job: Optional[PreparedJob]) -> str:
    return f"job {job.spec.name}: " if job is not None else ""


def _lock_all(prepared: list[PreparedJob], held: ExitStack) -> dict[Path, OutputLock]:
    """Every job's output folder, locked for the whole file (a busy one: exit 2 before anything runs)."""
    locks: dict[Path, OutputLock] = {}
    for job in prepared:
        path = job.spec.output.path
        if path not in locks:
            try:
                locks[path] = held.enter_context(lock_output(job))
            except JobError as exc:
                _fail(str(exc), EXIT_BAD_INPUT)
    return locks


@main.command()
@click.argument("job_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--job", "job_name", default=None, help="Plan only the job with this name.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Also predict the balance of the work units over N workers.")
@click.option("--per-window", is_flag=True, help="Also plan in the engine's windows of rows, for comparison.")
@click.option("--unit-rows", type=click.IntRange(min=1), default=None, help="Rows per work unit (default: automatic).")
@click.option("--pipeline-stages", "stages", type=click.IntRange(min=1), default=None,
              help="Also show the layer split over N pipeline stages (default: the job's parallel.pipeline_stages).")
def plan(job_file: Path, job_name: Optional[str], workers: Optional[int], per_window: bool,
         unit_rows: Optional[int], stages: Optional[int]) -> None:
    """Tokenise and plan the jobs of JOB_FILE globally without loading a model."""
    from batchinfer.jobs.global_plan import UnitConfig
    from batchinfer.jobs.run.planning import plan_job_globally, render_global_plan, unit_config_with

    # Planning writes nothing into the output folder, so an existing one is no reason to refuse.
    prepared = _prepare_all(job_file, job_name, overwrite=True, stages=stages)
    console = Console()
    config = unit_config_with(UnitConfig(), unit_rows)
    for job in prepared:
        try:  # the planning pass reads the input again: a changed file or duplicate ids are bad input
            report = plan_job_globally(job, console, workers=workers, per_window=per_window, config=config)
        except JobError as exc:
            _fail(str(exc), EXIT_BAD_INPUT)
        render_global_plan(console, report)
        if job.spec.parallel.pipeline_stages > 1:
            console.print(f"pipeline stages: {_stage_split(job).describe()}", highlight=False)


def _stage_split(job: PreparedJob):
    """The job's layers over its pipeline stages, as the engine will split them (bf16 weights on CUDA)."""
    from batchinfer.models.config import load_model_config
    from batchinfer.models.stage_split import split_layers

    return split_layers(load_model_config(job.checkpoint), job.spec.parallel.pipeline_stages)


@main.command()
@click.argument("job_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--job", "job_name", default=None, help="Warm up only the job with this name.")
def warmup(job_file: Path, job_name: Optional[str]) -> None:
    """Compile the Triton kernels the jobs of JOB_FILE need into the compile cache (TRITON_CACHE_DIR),
    without reading weights or inputs, so their first run starts warm."""
    from batchinfer.jobs.run.warmup import warm_up_job_file

    try:
        warm_up_job_file(job_file, job_name, echo=click.echo)
    except JobError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    except OSError as exc:
        _fail(f"{job_file}: {exc}", EXIT_BAD_INPUT)


@main.command()
@click.argument("out_dir")
def show(out_dir: str) -> None:
    """Print the summary of the job whose output folder is OUT_DIR (a folder or s3:// URL): finished,
    stopped or still running (its last _stats.json, the samples its parts hold, the run holding it)."""
    from batchinfer.jobs.outdir.object_store import StoreError
    from batchinfer.jobs.outdir.show import folder_report, remote_folder_report, render_report
    from batchinfer.jobs.spec.urls import is_url

    where = out_dir.rstrip("/") if is_url(out_dir) else Path(out_dir)  # a Path would fold s3:// into s3:/
    try:
        report = remote_folder_report(where) if isinstance(where, str) else folder_report(where)
    except (JobError, StoreError) as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    render_report(Console(), where, report)
