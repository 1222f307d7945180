"""`batchinfer run jobs.yaml` and `batchinfer plan jobs.yaml`.

Exit codes: 0 done; 2 bad input (one line `error: <file>: <key/column>: <what>`, nothing
written); 1 a runtime failure (finished parts stay on disk, a rerun resumes); 130 Ctrl-C.
Every job in the file is checked before the first one runs, so a mistake in the last job
does not leave the first one half done.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn, Optional

import click
from rich.console import Console

from batchinfer import __version__
from jobs.errors import JobError, JobRuntimeError
from jobs.prepare import PreparedJob, prepare_job
from jobs.runner import run_job
from jobs.spec import load_job_file

EXIT_RUNTIME_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _prepare_all(job_file: Path, job_name: Optional[str], overwrite: bool) -> list[PreparedJob]:
    try:
        specs = load_job_file(job_file).select(job_name)
        return [prepare_job(spec, overwrite) for spec in specs]
    except JobError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    except OSError as exc:  # unreadable files, permissions: still the user's input
        _fail(f"{job_file}: {exc}", EXIT_BAD_INPUT)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="batchinfer")
def main() -> None:
    """Offline batch inference for GDN-hybrid language models."""


@main.command()
@click.argument("job_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--job", "job_name", default=None, help="Run only the job with this name.")
@click.option("--overwrite", is_flag=True, help="Delete earlier outputs of the job(s) instead of resuming.")
def run(job_file: Path, job_name: Optional[str], overwrite: bool) -> None:
    """Run the jobs of JOB_FILE (resuming where an earlier run stopped)."""
    prepared = _prepare_all(job_file, job_name, overwrite)
    console = Console()
    for job in prepared:
        try:
            run_job(job, console, overwrite=overwrite)
        except JobRuntimeError as exc:
            _fail(f"{exc} (finished parts are kept; rerun to resume)", EXIT_RUNTIME_FAILURE)
        except KeyboardInterrupt:
            _fail(f"job {job.spec.name}: interrupted (finished parts are kept; rerun to resume)", EXIT_INTERRUPTED)


@main.command()
@click.argument("job_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--job", "job_name", default=None, help="Plan only the job with this name.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Also predict the balance of the work units over N workers.")
@click.option("--per-window", is_flag=True, help="Also plan in the engine's windows of rows, for comparison.")
@click.option("--unit-rows", type=click.IntRange(min=1), default=None, help="Rows per work unit (default: automatic).")
def plan(job_file: Path, job_name: Optional[str], workers: Optional[int], per_window: bool,
         unit_rows: Optional[int]) -> None:
    """Tokenise and plan the jobs of JOB_FILE globally without loading a model."""
    from jobs.global_plan import UnitConfig
    from jobs.planning import plan_job_globally, render_global_plan, unit_config_with

    # Planning writes nothing into the output folder, so an existing one is no reason to refuse.
    prepared = _prepare_all(job_file, job_name, overwrite=True)
    console = Console()
    config = unit_config_with(UnitConfig(), unit_rows)
    for job in prepared:
        render_global_plan(console, plan_job_globally(job, console, workers=workers, per_window=per_window,
                                                      config=config))
