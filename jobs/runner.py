"""One prepared job end to end: stream rows through the engine into output parts.

`run_job` takes the output folder's lock, verifies what earlier runs left there, loads the
engine, then hands it a lazy stream of requests built window by window (memory stays
bounded by the window, not the input), skips samples that an earlier run finished, records
rows without a prompt as errors, and commits parts as samples finish. Output rows are in
completion order, within a part and across parts (not input order).
"""
from __future__ import annotations

import bisect
import json
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

from rich.console import Console

from batchinfer.engine.types import Request, RequestOutput
from jobs.errors import JobError, JobRuntimeError, display_path
from jobs.inputs import RowWindow, iter_windows
from jobs.output_lock import OutputBusy, OutputLock
from jobs.outputs import PartWriter, SampleResult
from jobs.part_store import PARTS_DIR, damaged_path
from jobs.prepare import PreparedJob
from jobs.progress import ProgressReporter
from jobs.prompts import build_prompts
from jobs.resume import STATS_NAME, ResumeState, check_resumable, prepare_output_dir, read_resume_state
from jobs.spec import JobSpec, engine_config_kwargs, engine_settings_dict
from jobs.stats import JobCounters, build_stats, render_summary, write_stats

WINDOW_ROWS = 4096  # rows tokenised, planned and held in memory at a time


class EngineLike(Protocol):
    """What the runner needs from `batchinfer.engine.Engine` (tests pass a fake)."""

    stats: Any

    def generate(self, requests: Iterable[Request]) -> Iterator[RequestOutput]: ...

    def settings(self) -> dict: ...


def open_engine(job: PreparedJob, window_rows: int = WINDOW_ROWS) -> EngineLike:
    from batchinfer.engine import Engine, EngineConfig

    # The engine plans `plan_window` requests at a time and pulls the next window only when
    # its queue runs dry: memory stays bounded and there is no pause between windows.
    config = EngineConfig(**engine_config_kwargs(job.spec.engine), plan_window=window_rows)
    return Engine.from_pretrained(str(job.checkpoint), config, eos_token_ids=job.tokenizer.eos_token_ids,
                                  detokenize=job.tokenizer.decode)


def _seed_key(row_index: int, row_id: Any) -> int:
    """Per-row RNG key: the id column's value when given, so samples follow the row, not its position."""
    if row_id is None:
        return row_index
    if isinstance(row_id, int) and not isinstance(row_id, bool):
        return row_id & 0x7FFF_FFFF_FFFF_FFFF
    return zlib.crc32(repr(row_id).encode())


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """Generated text ends before the first stop string (which the engine's tokens may include)."""
    cut = min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class _OpenWindows:
    """Input windows whose samples are not all finished, found by row index.

    The engine pulls the next window of requests while the previous one still decodes, so
    outputs of two windows interleave; a window is dropped once its last sample is recorded.
    """

    def __init__(self) -> None:
        self._windows: dict[int, RowWindow] = {}
        self._pending: dict[int, int] = {}
        self._starts: list[int] = []  # first rows, ascending (windows open in input order)

    def open(self, window: RowWindow, samples: int) -> None:
        self._windows[window.first_row] = window
        self._pending[window.first_row] = samples
        self._starts.append(window.first_row)

    def take(self, row: int) -> RowWindow:
        """The window holding `row`; counts one of its samples as finished."""
        start = self._starts[bisect.bisect_right(self._starts, row) - 1]
        window = self._windows[start]
        self._pending[start] -= 1
        if self._pending[start] == 0:
            del self._windows[start], self._pending[start]
            self._starts.remove(start)
        return window


class _JobRun:
    """The mutable state of one run: writer, progress and open windows."""

    def __init__(self, job: PreparedJob, engine: EngineLike, writer: PartWriter, progress: ProgressReporter,
                 done: dict[int, frozenset[int]], window_rows: int) -> None:
        self.job, self.engine, self.writer, self.progress, self.done = job, engine, writer, progress, done
        self.window_rows = window_rows
        self.windows = _OpenWindows()

    def record(self, result: SampleResult) -> None:
        window = self.windows.take(result.row_index)
        self.writer.add(window.table, result.row_index - window.first_row, result)
        self.progress.advance(result)

    def requests(self) -> Iterator[Request]:
        """Requests for every unfinished sample, window by window, as the engine asks for them.

        Rows without a prompt are recorded as errors right here; they never reach the engine.
        """
        spec = self.job.spec
        n = spec.sampling.n
        for window in iter_windows(self.job.inputs, self.window_rows, spec.limit):
            rows = range(window.first_row, window.first_row + window.table.num_rows)
            todo = {row: [s for s in range(n) if s not in self.done.get(row, ())] for row in rows}
            samples_todo = sum(len(samples) for samples in todo.values())
            if not samples_todo:  # finished by an earlier run: not even tokenised again
                continue
            self.windows.open(window, samples_todo)
            prompts = build_prompts(window.table, spec.prompt, self.job.tokenizer, spec.chat, spec.system,
                                    self.job.vocab_size)
            row_ids = window.table[spec.id_column].to_pylist() if spec.id_column else [None] * len(rows)
            for offset, row in enumerate(rows):
                error = prompts.errors[offset]
                if not todo[row]:
                    continue
                if error is not None:
                    for sample in todo[row]:
                        self.record(SampleResult(row, sample, "", (), 0, 0, 0, "error", error))
                    continue
                yield Request(request_id=row, prompt_token_ids=tuple(prompts.token_ids[offset]),
                              sampling=spec.sampling, seed_key=_seed_key(row, row_ids[offset]),
                              skip_samples=tuple(sorted(self.done.get(row, ()))))

    def run(self) -> None:
        stops = self.job.spec.sampling.stop
        for output in self.engine.generate(self.requests()):
            text = _cut_at_stop(self.job.tokenizer.decode(output.token_ids), stops)
            self.record(SampleResult(
                row_index=int(output.request_id), sample_index=output.sample_index, generated_text=text,
                output_token_ids=tuple(output.token_ids), prompt_tokens=output.prompt_tokens,
                cached_tokens=output.cached_tokens, completion_tokens=output.completion_tokens,
                finish_reason=output.finish_reason, error=output.error))


def lock_output(job: PreparedJob) -> OutputLock:
    """Take the job's output folder for this run, or raise JobError naming the run that holds it."""
    spec = job.spec
    out_dir = spec.output.path
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


def run_job(job: PreparedJob, console: Console, overwrite: bool = False,
            engine_factory: Callable[[PreparedJob, int], EngineLike] = open_engine,
            window_rows: int = WINDOW_ROWS, lock: Optional[OutputLock] = None,
            warn: Callable[[str], None] = warn_on_stderr) -> dict[str, Any]:
    """Run a prepared job; returns the stats written to `_stats.json`.

    Holds the output folder's lock for the whole run: `lock` when the caller took it (the
    CLI takes every job's before the first runs), else its own. Raises JobError when the
    folder is busy or was changed meanwhile, JobRuntimeError when the engine fails; every
    sample finished until then is on disk.
    """
    if lock is not None:
        return _run_locked(job, console, overwrite, engine_factory, window_rows, lock, warn)
    with lock_output(job) as own_lock:
        return _run_locked(job, console, overwrite, engine_factory, window_rows, own_lock, warn)


def _report_parts(resume: ResumeState, warn: Callable[[str], None]) -> None:
    for path, reason in resume.damaged:
        warn(f"{display_path(path)}: damaged ({reason}); moved to {damaged_path(path).name}, its rows are redone")
    for path in resume.foreign:
        warn(f"{display_path(path)}: not written by batchinfer (no record in {PARTS_DIR}/); ignored for resume "
             "and left in place, but dataset readers of the folder will read it too")


def _interruption(exc: BaseException) -> str:
    name = getattr(exc, "signal_name", None)
    return name if isinstance(name, str) else "SIGINT" if isinstance(exc, KeyboardInterrupt) else type(exc).__name__


def _run_locked(job: PreparedJob, console: Console, overwrite: bool,
                engine_factory: Callable[[PreparedJob, int], EngineLike], window_rows: int, lock: OutputLock,
                warn: Callable[[str], None]) -> dict[str, Any]:
    spec = job.spec
    start = time.monotonic()
    out_dir = spec.output.path
    total = job.rows * spec.sampling.n
    # Checked again now that no other run can change the folder under us.
    check_resumable(out_dir, job.fingerprint, overwrite, spec.job_file, spec.where("output"))
    resume = read_resume_state(out_dir, overwrite)
    _report_parts(resume, warn)
    resumed = _finished_samples(resume, job.rows)
    engine: Optional[EngineLike] = None
    writer = PartWriter(out_dir, spec.output.flush_rows, resume.next_part, before_commit=lock.ensure_held)

    def finish(status: str, failure: Optional[str] = None, interrupted_by: Optional[str] = None) -> dict[str, Any]:
        if lock.lost:  # the folder is another run's now: write nothing more into it
            raise _lost(lock, spec)
        counters = JobCounters(rows=job.rows, samples_total=total, samples_resumed=resumed,
                               samples_written=writer.rows_written, errors=writer.error_rows_written,
                               wall_seconds=time.monotonic() - start)
        stats = build_stats(spec.name, counters, getattr(engine, "stats", None), _settings(engine, spec), status,
                            failure, interrupted_by)
        write_stats(out_dir / STATS_NAME, stats)
        return stats

    if resumed == total:  # nothing to run: load no model
        previous = _read_stats(out_dir)
        if not overwrite and not resume.damaged and previous.get("status") == "done":
            # Keep the stats of the run that did the work.
            console.print(f"job {spec.name}: all {total} samples already in {display_path(out_dir)}",
                          highlight=False, markup=False)
            return previous
        _prepare_output_dir(job, overwrite, resume, lock)
        stats = finish("done")
        render_summary(console, stats)
        return stats
    try:
        engine = engine_factory(job, window_rows)
    except Exception as exc:
        raise JobRuntimeError(spec.name, f"cannot load the model: {type(exc).__name__}: {exc}") from exc
    _prepare_output_dir(job, overwrite, resume, lock)
    run = _JobRun(job, engine, writer, ProgressReporter(console, spec.name, total, resumed), resume.done,
                  window_rows)
    try:
        with run.progress:
            run.run()
        writer.flush()
    except BaseException as exc:
        if lock.lost:
            raise _lost(lock, spec) from None
        try:
            writer.flush()  # every buffered sample is complete: keep it
        except Exception:  # e.g. the disk is full: report the original failure, not this one
            pass
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SIGTERM, SystemExit: stop quietly
            finish("interrupted", interrupted_by=_interruption(exc))
            raise
        reason = f"{type(exc).__name__}: {exc}"
        finish("failed", reason)
        raise JobRuntimeError(spec.name, reason) from exc
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


def _settings(engine: Optional[EngineLike], spec: JobSpec) -> dict[str, Any]:
    settings = getattr(engine, "settings", None)
    return settings() if callable(settings) else engine_settings_dict(spec.engine)
