"""One prepared job end to end: plan, run, commit parts, and (on request) put them in input order.

`run_job` takes the output folder's lock, finishes or undoes what a killed run left there (an interrupted
compaction), verifies the finished parts, then plans the job into units (`global_run.plan_units`: plan
`global`, the default, sorts every prompt and cuts prefix groups; plan `window`, `run_job(plan="window")`, a
benchmark's comparison arm and not a job key, cuts `window_rows` consecutive rows in input order), and hands
the unfinished units to the job's executor (`job_executor`: one engine in this process, `in_process`, or
several engine workers, `parallel_run`, when the job's `parallel` settings resolve to more than one), driven
the same way either way. Samples already in finished parts are skipped, rows without a prompt are recorded
as errors, and each unit's parts are committed as its chunks finish. With `output.order: input` the parts
are then rewritten in input order (`ordered_output`). The planning folder `_work/` is deleted when the job
completes, unless `output.keep_work`.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence

from rich.console import Console

from batchinfer.engine.types import Request, RequestOutput
from batchinfer.jobs.errors import JobError, JobRuntimeError, display_path, no_space_error
from batchinfer.jobs.tasks.eval_metrics import eval_stats
from batchinfer.jobs.global_plan import SortBudget, UnitConfig, remove_work_dir, work_dir_for
from batchinfer.jobs.outdir.interruption import signal_name, stop_signal_of
from batchinfer.jobs.run.global_run import PlannedUnits, plan_stats, plan_units, prepare_units
from batchinfer.jobs.run.job_executor import JobExecutor, UnitExecutor, job_executor
from batchinfer.jobs.formats.openai_batch import OUTPUT_NAME as BATCH_OUTPUT_NAME, write_batch_output
from batchinfer.jobs.outdir.ordered_output import compact_in_input_order, finish_interrupted_compaction
from batchinfer.jobs.outdir.lock import OutputBusy, OutputLock
from batchinfer.jobs.outdir.remote_folder import RemoteOutputLock
from batchinfer.jobs.outdir.part_store import PARTS_DIR, damaged_path, scan_parts
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.engine.startup import listening, phase
from batchinfer.jobs.run.progress import ProgressReporter, computed_tokens_to_do
from batchinfer.jobs.outdir.resume import STATS_NAME, ResumeState, check_resumable, prepare_output_dir, read_resume_state
from batchinfer.jobs.spec.job_file import JobSpec, engine_config_kwargs, engine_settings_dict
from batchinfer.jobs.outdir.stats import JobCounters, build_stats, render_summary, write_stats
from batchinfer.jobs.global_plan.windows import WindowCut

WINDOW_ROWS = 4096  # rows tokenised, planned and held in memory at a time


class EngineLike(Protocol):
    """What the runner needs from `batchinfer.engine.Engine` (tests pass a fake)."""

    stats: Any

    def generate_units(self, units: Iterable[Sequence[Request]]) -> Iterator[RequestOutput]: ...

    def settings(self) -> dict: ...


def open_engine(job: PreparedJob, window_rows: int = WINDOW_ROWS, row_tokens: Optional[int] = None) -> EngineLike:
    """The job's engine; `row_tokens`: the plan's row figure when it is known before the build (a
    worker's), else posted to the build by the in-process executor (`EngineBuild`)."""
    from batchinfer.engine import EngineConfig
    from batchinfer.engine.engine_build import build_engine

    # `plan_window`: what `Engine.generate` plans at a time; a job's units each go to generate_units whole.
    config = EngineConfig(**engine_config_kwargs(job.spec.engine), plan_window=window_rows,
                          pipeline_stages=job.spec.parallel.pipeline_stages, row_tokens=row_tokens)
    return build_engine(str(job.checkpoint), config, eos_token_ids=job.tokenizer.eos_token_ids,
                        detokenize=job.tokenizer.decode)


def lock_output(job: PreparedJob) -> OutputLock:
    """Take the job's output folder for this run, or raise JobError naming the run that holds it."""
    spec = job.spec
    out_dir = spec.output.path
    if spec.output.remote:  # s3://: the bucket's lock object, and the staging folder mirrored to it
        return RemoteOutputLock.acquire(spec)
    try:
        return OutputLock.acquire(out_dir)
    except OutputBusy as busy:
        raise JobError(spec.job_file, spec.where("output"),
                       f"{display_path(out_dir)} {busy}; wait for that run to end, or stop it") from None
    except OSError as exc:
        raise JobError(spec.job_file, spec.where("output"),
                       f"cannot write {display_path(out_dir)} ({exc.strerror or exc})") from None


def warn_on_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


PLANS = ("global", "window")  # window: the benchmarks' comparison arm, never a job key


@dataclass(frozen=True)
class RunOptions:
    engine_factory: Callable[[PreparedJob, int], EngineLike] = open_engine
    window_rows: int = WINDOW_ROWS                # the engine's plan window; plan window: rows per unit
    unit_config: UnitConfig = UnitConfig()        # plan global: unit limits
    sort_budget: SortBudget = SortBudget()        # plan global: the external sort's memory
    executor: Optional[UnitExecutor] = None       # None: from the job's `parallel` settings
    plan: str = "global"                          # one of PLANS


def run_job(job: PreparedJob, console: Console, overwrite: bool = False,
            engine_factory: Callable[[PreparedJob, int], EngineLike] = open_engine,
            window_rows: int = WINDOW_ROWS, lock: Optional[OutputLock] = None,
            warn: Callable[[str], None] = warn_on_stderr, unit_config: UnitConfig = UnitConfig(),
            sort_budget: SortBudget = SortBudget(), executor: Optional[UnitExecutor] = None,
            plan: str = "global") -> dict[str, Any]:
    """Run a prepared job; returns the stats written to `_stats.json`.

    Holds the output folder's lock for the whole run: `lock` when the caller took it (the CLI takes every
    job's before the first runs), else its own. Raises JobError when the folder is busy or was changed
    meanwhile, JobRuntimeError when the engine fails; every sample finished until then is on disk.
    `executor`: `(job, plan, out_dir, console, unit_ids=) -> report` runs the units (as a
    `parallel_run.WorkersExecutor`); None: the job's executor (`job_executor.job_executor`). `plan`: `global`,
    or `window` (units of `window_rows` consecutive rows in input order: a benchmark's arm).
    """
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {PLANS}, not {plan!r}")
    options = RunOptions(engine_factory, window_rows, unit_config, sort_budget, executor, plan)
    if lock is not None:
        return _run_locked(job, console, overwrite, options, lock, warn)
    with lock_output(job) as own_lock:
        return _run_locked(job, console, overwrite, options, own_lock, warn)


def _report_parts(resume: ResumeState, warn: Callable[[str], None]) -> None:
    for path, reason in resume.damaged:
        warn(f"{display_path(path)}: damaged ({reason}); moved to {damaged_path(path).name}, its rows are redone")
    for path in resume.foreign:
        warn(f"{display_path(path)}: not written by batchinfer (no record in {PARTS_DIR}/); ignored for resume "
             "and left in place, but dataset readers of the folder will read it too")


def _interruption(exc: BaseException) -> str:
    """`interrupted_by`: the stop signal's name (jobs.outdir.interruption), else what stopped the run (SystemExit)."""
    signum = stop_signal_of(exc)
    if signum is not None:
        return signal_name(signum)
    name = getattr(exc, "signal_name", None)  # an embedding caller's own stop exception
    return name if isinstance(name, str) else type(exc).__name__


def _raise_interruption(report: Any) -> None:
    """Stop as for the signal that interrupted the workers (the parallel run's own rule)."""
    try:
        from batchinfer.jobs.run.parallel_run import raise_interruption
    except ImportError:
        raise KeyboardInterrupt() from None
    raise_interruption(report)
    raise KeyboardInterrupt()


def _reorder(job: PreparedJob, lock: OutputLock, console: Console) -> None:
    """output.order input: every finished part rewritten in (row, sample) order."""
    spec = job.spec
    out_dir = spec.output.path
    state = read_resume_state(out_dir)  # verified again: what the merge reads must be what was committed
    if state.in_input_order and not state.damaged:
        return
    if state.damaged:
        raise JobRuntimeError(spec.name, f"{display_path(state.damaged[0][0])} was damaged after it was "
                                         f"committed ({state.damaged[0][1]}); rerun to redo its rows")
    console.print(f"[{spec.name}] writing {state.finished_samples:,} samples in input order", highlight=False,
                  markup=False)
    compact_in_input_order(out_dir, state.parts, state.unsorted_parts, state.next_part, spec.output.flush_rows,
                           spec.sampling.n, work_dir_for(out_dir) / ".compact", before_commit=lock.ensure_held)


def _complete_work_dir(spec: JobSpec) -> None:
    """The job is complete: its planning folder goes, unless output.keep_work."""
    if not spec.output.keep_work:
        remove_work_dir(work_dir_for(spec.output.path))


def _run_locked(job: PreparedJob, console: Console, overwrite: bool, options: RunOptions, lock: OutputLock,
                warn: Callable[[str], None]) -> dict[str, Any]:
    spec = job.spec
    start = time.monotonic()
    out_dir = spec.output.path
    total = job.rows * spec.sampling.n
    # Checked again now that no other run can change the folder under us.
    check_resumable(out_dir, job.fingerprint, overwrite, spec.job_file, spec.where("output"))
    if not overwrite and out_dir.is_dir():
        undone = finish_interrupted_compaction(out_dir)
        if undone:
            warn(f"{display_path(out_dir)}: the interrupted rewrite in input order was {undone}")
    resume = read_resume_state(out_dir, overwrite)
    _report_parts(resume, warn)
    resumed = _finished_samples(resume, job.rows)
    reorder = spec.output.order == "input"
    planned: Optional[PlannedUnits] = None
    executor: Optional[JobExecutor] = None
    report: Any = None
    startup: dict[str, float] = {}  # load, compile_and_capture (the engine's), plan
    generation_start: Optional[float] = None
    generation_seconds: Optional[float] = None  # set when generation ends (an interrupted run: until finish)

    def finish(status: str, failure: Optional[str] = None, interrupted_by: Optional[str] = None) -> dict[str, Any]:
        if lock.lost:  # the folder is another run's now: write nothing more into it
            raise _lost(lock, spec)
        counters = JobCounters(rows=job.rows, samples_total=total, samples_resumed=resumed,
                               samples_written=executor.samples_written if executor is not None else 0,
                               errors=executor.errors_written if executor is not None else 0,
                               wall_seconds=time.monotonic() - start, startup_seconds=dict(startup),
                               generation_seconds=generation_seconds if generation_seconds is not None else
                               None if generation_start is None else time.monotonic() - generation_start)
        engine_stats = executor.engine_stats() if executor is not None else None
        settings = (executor.settings() if executor is not None else None) or \
            engine_settings_dict(spec.engine, options.plan)
        stats = build_stats(spec.name, counters, engine_stats, settings, status, failure, interrupted_by)
        if job.sampling is not None:
            stats["sampling"] = job.sampling.report()
        if planned is not None:
            stats["plan"] = plan_stats(planned)
            for name in ("planned_reuse_lost_tokens", "branch_states_over_capacity"):  # a plan the pool could not hold
                stats["plan"][name] = getattr(engine_stats, name, 0) if engine_stats is not None else 0
        if getattr(report, "stats", None) is not None:  # units on workers: their section
            stats["executor"] = report.stats
        if spec.task.eval is not None:
            stats["eval"] = eval_stats(spec.task.eval, [path for path, _ in scan_parts(out_dir, verify=False).finished],
                                       id_column=spec.id_column)
        write_stats(out_dir / STATS_NAME, stats)
        return stats

    if resumed == total:  # nothing to run: load no model
        previous = _read_stats(out_dir)
        in_order = resume.in_input_order or not reorder
        if not overwrite and not resume.damaged and previous.get("status") == "done" and in_order:
            # Keep the stats of the run that did the work.
            if spec.output.format == "openai" and not (out_dir / BATCH_OUTPUT_NAME).is_file():
                write_batch_output(out_dir, spec, lock.ensure_held, job.tokenizer)  # killed while writing it
            _complete_work_dir(spec)
            console.print(f"job {spec.name}: all {total} samples already in {display_path(out_dir)}",
                          highlight=False, markup=False)
            return previous
        _prepare_output_dir(job, overwrite, resume, lock)
        if reorder:
            _reorder(job, lock, console)
        if spec.output.format == "openai":
            write_batch_output(out_dir, spec, lock.ensure_held, job.tokenizer)
        _complete_work_dir(spec)
        stats = finish("done")
        render_summary(console, stats)
        return stats
    progress = ProgressReporter(console, spec.name, total, resumed)
    executor = job_executor(job, options.executor, options.engine_factory, options.window_rows, progress,
                            lock.ensure_held)
    try:
        with listening(progress.phase_listener):  # the startup phases, shown as they run
            # In this process the engine builds while the job plans, and is sized by the plan (engine_build.py).
            executor.start(job)
            work_dir = work_dir_for(out_dir)
            made_work_dir = overwrite or not work_dir.exists()
            windows = WindowCut(options.window_rows) if options.plan == "window" else None
            try:
                if lock.lost:  # planning writes into the folder: only while it is ours
                    raise _lost(lock, spec)
                if overwrite:
                    remove_work_dir(work_dir)
                with phase("planning", startup, "plan"):
                    planned = plan_units(job, work_dir, console, options.unit_config, options.sort_budget, warn,
                                         windows)
                summary = planned.plan.summary
                progress.set_prefill_total(computed_tokens_to_do(summary, total, resumed))
                executor.planned(summary)
            finally:  # a model that cannot load fails the run as before, and leaves the folder as it was
                try:
                    startup.update(executor.ready())
                except Exception as exc:
                    if made_work_dir:
                        remove_work_dir(work_dir)
                    raise JobRuntimeError(spec.name, f"cannot load the model: {type(exc).__name__}: {exc}") from exc
    except Exception:
        raise
    except BaseException as exc:  # a stop signal while loading or planning: stopped like any other
        if not lock.lost:
            finish("interrupted", interrupted_by=_interruption(exc))
        raise
    _prepare_output_dir(job, overwrite, resume, lock)
    (out_dir / BATCH_OUTPUT_NAME).unlink(missing_ok=True)  # an earlier run's lines: rewritten when the job completes
    generation_start = time.monotonic()
    try:
        assert planned is not None
        unit_ids = prepare_units(job, planned, out_dir, resume)
        report = executor.run(job, planned, out_dir, console, unit_ids)
        status = getattr(report, "status", "done")
        if status == "interrupted":
            _raise_interruption(report)
        if status != "done":
            raise RuntimeError(getattr(report, "failure", None) or "the workers failed")
        generation_seconds = time.monotonic() - generation_start
        if reorder:
            _reorder(job, lock, console)
        if spec.output.format == "openai":
            write_batch_output(out_dir, spec, lock.ensure_held, job.tokenizer)
    except BaseException as exc:
        if lock.lost:
            raise _lost(lock, spec) from None
        try:  # every buffered sample is complete: keep it
            executor.flush_partial()
        except Exception:  # e.g. the disk is full: report the original failure, not this one
            pass
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SIGTERM, SystemExit: stop quietly
            finish("interrupted", interrupted_by=_interruption(exc))
            raise
        if isinstance(exc, JobError):  # an input file changed under the run: bad input, exit 2
            finish("failed", str(exc))
            raise
        reason = exc.reason if isinstance(exc, JobRuntimeError) else f"{type(exc).__name__}: {exc}"
        try:
            finish("failed", reason)
        except OSError as stats_error:  # a full disk takes the stats too: report the failure itself
            if no_space_error(stats_error) is None:
                raise
        raise JobRuntimeError(spec.name, reason) from exc
    _complete_work_dir(spec)
    stats = finish("done")
    render_summary(console, stats)
    return stats


def _prepare_output_dir(job: PreparedJob, overwrite: bool, resume: ResumeState, lock: OutputLock) -> None:
    if lock.lost:  # it deletes temporaries: only ever while the folder is ours
        raise _lost(lock, job.spec)
    prepare_output_dir(job.spec.output.path, job.fingerprint, overwrite, resume)


def _lost(lock: OutputLock, spec: JobSpec) -> JobRuntimeError:
    return JobRuntimeError(spec.name, f"{display_path(lock.path)} was taken over by another run (this one went "
                                      "unrefreshed past the stale timeout); stopped without writing more")


def _read_stats(out_dir: Path) -> dict[str, Any]:
    try:
        stats = json.loads((out_dir / STATS_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


def _finished_samples(resume: ResumeState, rows: int) -> int:
    """Samples of the job's rows (those within `limit`) already in verified parts."""
    return sum(len(samples) for row, samples in resume.done.items() if row < rows)
