"""Running work units: the one place a unit's rows go to the engine and its parts are committed.

    runner = UnitRunner(job, engine, plan, out_dir, progress)
    for result in runner.run_units(unit_ids):   # UnitResult per unit, once its parts are committed
        ...

Each unit's rows (`WorkPlan.read_unit`, in plan order) go to `engine.generate_units` as one
planning unit; one call runs all the given units, so the engine starts unit k + 1 while unit k
finishes. Pairs done when the run started (`unit_parts.DoneIndex`) are skipped, rows without a
prompt are recorded as errors without reaching the engine (`row_requests`), and each chunk of the unit's rows is
committed as its fixed part (`unit_parts`) through `part_writer.commit_results`, sorted by
(row_index, sample_index), beside every input column (`unit_inputs.UnitInputs`). The in-process
run calls it with every unit; each worker of a parallel run calls `run_units([unit_id])`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence

import pyarrow as pa

from batchinfer.engine.types import Request, RequestOutput
from batchinfer.jobs.run.engine_io import output_result
from batchinfer.jobs.run.row_requests import RowRequests
from batchinfer.jobs.run.executors.contract import ProgressDelta, UnitResult
from batchinfer.jobs.tasks.eval_metrics import with_correct_column
from batchinfer.jobs.global_plan import WorkPlan
from batchinfer.jobs.outdir.part_writer import ROW_INDEX_COLUMN, SampleResult, append_results, commit_results, job_result_fields
from batchinfer.jobs.outdir.part_store import unit_part_name
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.global_plan.unit_inputs import UnitInputs
from batchinfer.jobs.outdir.unit_parts import DoneIndex, chunk_rows, unit_part_committed


class UnitEngine(Protocol):
    """What the unit runner needs from `batchinfer.engine.Engine` (tests pass a fake)."""

    stats: Any

    def generate_units(self, units: Iterable[Sequence[Request]]) -> Iterator[RequestOutput]: ...


class UnitProgress(Protocol):
    def sample_done(self, unit_id: int, result: SampleResult) -> None: ...


class _NoProgress:
    def sample_done(self, unit_id: int, result: SampleResult) -> None:
        pass


class ReporterProgress:
    """Progress into a `jobs.progress.ProgressReporter` (the in-process run's bar)."""

    def __init__(self, reporter: Any) -> None:
        self.reporter = reporter

    def sample_done(self, unit_id: int, result: SampleResult) -> None:
        self.reporter.advance(result)


class SinkProgress:
    """Progress into an executor's `ProgressSink` (a worker reporting to its parent)."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def sample_done(self, unit_id: int, result: SampleResult) -> None:
        self.sink.report(unit_id, ProgressDelta(1, result.prompt_tokens, result.cached_tokens,
                                                result.completion_tokens))


def as_unit_progress(progress: Any) -> UnitProgress:
    """A ProgressReporter (advance), a ProgressSink (report), a UnitProgress, or None."""
    if progress is None:
        return _NoProgress()
    if hasattr(progress, "sample_done"):
        return progress
    if hasattr(progress, "report"):
        return SinkProgress(progress)
    if hasattr(progress, "advance"):
        return ReporterProgress(progress)
    raise TypeError(f"not a progress object: {progress!r}")


@dataclass
class _OpenUnit:
    """One unit while it runs: its input rows, its chunks still open, and what it wrote."""

    unit_id: int
    inputs: pa.Table                      # input columns + row_index, sorted by row_index
    position: dict[int, int]              # row_index → row of `inputs`
    chunk_of_row: dict[int, int]
    left: dict[int, int]                  # open chunk → samples still to come
    pending: dict[int, list[SampleResult]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    stops: dict[int, tuple[str, ...]] = field(default_factory=dict)  # row → its own stop strings (batch input)
    parts: list[str] = field(default_factory=list)
    samples_written: int = 0
    samples_skipped: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def complete(self) -> bool:
        return not self.left


def _stats_numbers(stats: Any) -> dict[str, float]:
    if stats is None:
        return {}
    names = [f.name for f in fields(stats)] if hasattr(stats, "__dataclass_fields__") else list(vars(stats))
    return {name: getattr(stats, name) for name in names
            if isinstance(getattr(stats, name), (int, float)) and not isinstance(getattr(stats, name), bool)}


class UnitRunner:
    def __init__(self, job: PreparedJob, engine: UnitEngine, plan: WorkPlan, out_dir: Path, progress: Any = None,
                 *, before_commit: Callable[[], None] = lambda: None, inputs: Optional[UnitInputs] = None,
                 done: Optional[DoneIndex] = None) -> None:
        self.job, self.engine, self.plan, self.out_dir = job, engine, plan, Path(out_dir)
        self.progress = as_unit_progress(progress)
        self.before_commit = before_commit
        opened = inputs if inputs is not None else UnitInputs.open(plan)
        if opened is None:
            raise RuntimeError(f"{plan.work_dir} holds no unit inputs for these units")
        self.inputs = opened
        self.done = done if done is not None else DoneIndex(plan.work_dir)
        sampling = job.spec.sampling
        self.n, self.per_chunk = sampling.n, chunk_rows(job.spec.output.flush_rows, sampling.n)
        self.fields = job_result_fields(job.spec)
        self.rows = RowRequests(job)
        self._counters = _stats_numbers(getattr(engine, "stats", None))
        self.samples_committed = 0  # over every unit run, in committed parts (on disk)
        self.errors_committed = 0
        self._open_units: list[_OpenUnit] = []

    # ---- one unit ---------------------------------------------------------------------------
    def _open(self, unit_id: int) -> _OpenUnit:
        rows = self.plan.read_unit(unit_id)
        inputs = self.inputs.read(unit_id)
        indices = inputs[ROW_INDEX_COLUMN].to_pylist()
        if sorted(row.row_index for row in rows) != indices:
            raise RuntimeError(f"unit {unit_id}: its input rows do not match its planned rows")
        position = {row: offset for offset, row in enumerate(indices)}
        columns = self.rows.columns(inputs)
        done = self.done.for_unit(unit_id)
        unit = _OpenUnit(unit_id, inputs, position, {}, {})
        for chunk, first in enumerate(range(0, len(rows), self.per_chunk)):
            members = rows[first:first + self.per_chunk]
            todo = {row.row_index: [s for s in range(self.n) if s not in done.get(row.row_index, ())]
                    for row in members}
            samples = sum(map(len, todo.values()))
            if not samples:
                continue
            unit.parts.append(unit_part_name(unit_id, chunk))
            if unit_part_committed(self.out_dir, unit_id, chunk):  # an earlier attempt in this run
                unit.samples_skipped += samples
                continue
            unit.left[chunk] = samples
            unit.pending[chunk] = []
            for row in members:
                unit.chunk_of_row[row.row_index] = chunk
                if not todo[row.row_index]:
                    continue
                unit.requests.extend(self.rows.for_row(
                    columns, position[row.row_index], row.row_index, row.token_ids, row.error, todo[row.row_index],
                    done.get(row.row_index), unit.stops, lambda result, unit=unit: self._record(unit, result)))
        unit.samples_skipped += sum(len(samples) for samples in done.values())
        return unit

    def _record(self, unit: _OpenUnit, result: SampleResult) -> None:
        chunk = unit.chunk_of_row[result.row_index]
        unit.pending[chunk].append(result)
        unit.left[chunk] -= 1
        self.progress.sample_done(unit.unit_id, result)
        if unit.left[chunk] == 0:
            self._commit(unit, chunk)

    def _commit(self, unit: _OpenUnit, chunk: int) -> None:
        """The chunk's part committed (write, fsync, record, rename), then counted and only then dropped
        from `pending`: a stop signal waits for the end of the section, a failure keeps the samples."""
        results = sorted(unit.pending[chunk], key=lambda r: (r.row_index, r.sample_index))
        offsets = pa.array([unit.position[r.row_index] for r in results], type=pa.int64())
        table = unit.inputs.take(offsets).drop_columns([ROW_INDEX_COLUMN])
        table = append_results(table, results, self.fields)
        table = with_correct_column(self.job.spec.task, table)
        commit_results(self.out_dir, unit_part_name(unit.unit_id, chunk), table, self.before_commit,
                       lambda: self._count(unit, chunk, results))

    def _count(self, unit: _OpenUnit, chunk: int, results: list[SampleResult]) -> None:
        del unit.pending[chunk]
        del unit.left[chunk]
        errors = sum(r.finish_reason == "error" for r in results)
        unit.samples_written += len(results)
        unit.errors += errors
        self.samples_committed += len(results)
        self.errors_committed += errors
        unit.prompt_tokens += sum(r.prompt_tokens for r in results)
        unit.cached_tokens += sum(r.cached_tokens for r in results)
        unit.output_tokens += sum(r.completion_tokens for r in results)

    def _result(self, unit: _OpenUnit) -> UnitResult:
        now = _stats_numbers(getattr(self.engine, "stats", None))
        counters = {name: (value if name.startswith("peak_") else value - self._counters.get(name, 0))
                    for name, value in now.items()}
        self._counters = now  # the next unit's counters start here: they add up to the engine's
        return UnitResult(unit_id=unit.unit_id, samples_written=unit.samples_written,
                          samples_skipped=unit.samples_skipped, prompt_tokens=unit.prompt_tokens,
                          cached_tokens=unit.cached_tokens, output_tokens=unit.output_tokens, errors=unit.errors,
                          parts=tuple(unit.parts), counters=counters)

    def flush_partial(self) -> None:
        """Commit what the open chunks hold, each under its chunk's name, when the run ends early
        (interrupted, or failed): nothing finished is lost. Only then: another attempt at these
        units in the same run would take such a part for a whole chunk. The next run renames it
        to a numbered part (`unit_parts.retire_foreign_unit_parts`) before redoing the chunk."""
        for unit in self._open_units:
            for chunk in list(unit.pending):
                if unit.pending[chunk]:
                    self._commit(unit, chunk)

    # ---- many units -------------------------------------------------------------------------
    def run_units(self, unit_ids: Iterable[int]) -> Iterator[UnitResult]:
        """Run the units (in the order given; the engine overlaps consecutive ones) and yield each
        one's result once all its parts are committed."""
        pulled: list[_OpenUnit] = []       # the engine's unit_index → unit
        self._open_units = pulled
        complete: list[_OpenUnit] = []     # finished without the engine (nothing left, or only errors)
        stops = self.job.spec.sampling.stop

        def engine_units() -> Iterator[list[Request]]:
            for unit_id in unit_ids:
                unit = self._open(unit_id)
                if not unit.requests:
                    complete.append(unit)
                    continue
                pulled.append(unit)
                yield unit.requests

        started = time.monotonic()
        for output in self.engine.generate_units(engine_units()):
            while complete:
                yield self._result(complete.pop(0))
            unit = pulled[output.unit_index]
            result = output_result(output, self.job.tokenizer, unit.stops.get(output.request_id, stops),
                                   self.job.reasoning, self.rows.scores)
            if result is not None:  # None: a scored row waiting for its other continuations
                self._record(unit, result)
            if output.unit_done:
                if not unit.complete:
                    raise RuntimeError(f"unit {unit.unit_id}: the engine ended it with samples missing")
                yield self._result(unit)
        while complete:
            yield self._result(complete.pop(0))
        unfinished = [unit.unit_id for unit in pulled if not unit.complete]
        if unfinished:
            raise RuntimeError(f"units {unfinished[:5]} ended with samples missing after "
                               f"{time.monotonic() - started:.0f}s")
