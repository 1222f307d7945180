"""One prepared job end to end: stream rows through the engine into output parts.

`run_job` loads the engine, then hands it a lazy stream of requests built window by window
(memory stays bounded by the window, not the input), skips samples that an earlier run
finished, records rows without a prompt as errors, and writes parts as samples finish.
"""
from __future__ import annotations

import bisect
import json
import time
import zlib
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

from rich.console import Console

from batchinfer.engine.types import Request, RequestOutput
from jobs.errors import JobRuntimeError
from jobs.inputs import RowWindow, iter_windows
from jobs.outputs import PartWriter, SampleResult
from jobs.prepare import PreparedJob
from jobs.progress import ProgressReporter
from jobs.prompts import build_prompts
from jobs.resume import STATS_NAME, ResumeState, prepare_output_dir, read_resume_state
from jobs.spec import JobSpec, engine_settings_dict
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
    config = EngineConfig(**engine_settings_dict(job.spec.engine), plan_window=window_rows)
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
    """The mutable state of one run: writer, progress, open windows and counters."""

    def __init__(self, job: PreparedJob, engine: EngineLike, writer: PartWriter, progress: ProgressReporter,
                 done: dict[int, frozenset[int]], window_rows: int) -> None:
        self.job, self.engine, self.writer, self.progress, self.done = job, engine, writer, progress, done
        self.window_rows = window_rows
        self.windows = _OpenWindows()
        self.written = 0
        self.errors = 0

    def record(self, result: SampleResult) -> None:
        window = self.windows.take(result.row_index)
        self.writer.add(window.table, result.row_index - window.first_row, result)
        self.progress.advance(result)
        self.written += 1
        self.errors += result.finish_reason == "error"

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


def run_job(job: PreparedJob, console: Console, overwrite: bool = False,
            engine_factory: Callable[[PreparedJob, int], EngineLike] = open_engine,
            window_rows: int = WINDOW_ROWS) -> dict[str, Any]:
    """Run a prepared job; returns the stats written to `_stats.json`.

    Raises JobRuntimeError when the engine fails; every sample finished until then is on disk.
    """
    spec = job.spec
    start = time.monotonic()
    out_dir = spec.output.path
    total = job.rows * spec.sampling.n
    if not overwrite and _finished_samples(read_resume_state(out_dir), job.rows) == total:
        # Nothing to do: load no model and keep the stats of the run that did the work.
        console.print(f"job {spec.name}: all {total} samples already in {out_dir}", highlight=False, markup=False)
        stats_path = out_dir / STATS_NAME
        return json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    try:
        engine = engine_factory(job, window_rows)
    except Exception as exc:
        raise JobRuntimeError(spec.name, f"cannot load the model: {type(exc).__name__}: {exc}") from exc
    prepare_output_dir(out_dir, job.fingerprint, overwrite)
    resume = read_resume_state(out_dir)
    resumed = _finished_samples(resume, job.rows)
    writer = PartWriter(out_dir, spec.output.flush_rows, resume.next_part)
    run = _JobRun(job, engine, writer, ProgressReporter(console, spec.name, total, resumed), resume.done,
                  window_rows)

    def finish(status: str, failure: Optional[str] = None) -> dict[str, Any]:
        counters = JobCounters(rows=job.rows, samples_total=total, samples_resumed=resumed,
                               samples_written=run.written, errors=run.errors,
                               wall_seconds=time.monotonic() - start)
        stats = build_stats(spec.name, counters, getattr(engine, "stats", None), _settings(engine, spec), status,
                            failure)
        write_stats(out_dir / STATS_NAME, stats)
        return stats

    try:
        with run.progress:
            run.run()
        writer.flush()
    except BaseException as exc:
        try:
            writer.flush()  # every buffered sample is complete: keep it
        except Exception:  # e.g. the disk is full: report the original failure, not this one
            pass
        if not isinstance(exc, Exception):  # KeyboardInterrupt / SystemExit: stop quietly
            finish("interrupted")
            raise
        reason = f"{type(exc).__name__}: {exc}"
        finish("failed", reason)
        raise JobRuntimeError(spec.name, reason) from exc
    stats = finish("done")
    render_summary(console, stats)
    return stats


def _finished_samples(resume: ResumeState, rows: int) -> int:
    """Samples of the job's rows (those within `limit`) already in finished parts."""
    return sum(len(samples) for row, samples in resume.done.items() if row < rows)


def _settings(engine: EngineLike, spec: JobSpec) -> dict[str, Any]:
    settings = getattr(engine, "settings", None)
    return settings() if callable(settings) else engine_settings_dict(spec.engine)
