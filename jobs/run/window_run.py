"""The per-window run (`run_job(plan="window")`, a benchmark's comparison arm): rows in input order, planned by
the engine a window at a time.

`WindowRun` hands one `engine.generate` call a lazy stream of requests built window by window
(memory stays bounded by the window, not the input), skips samples an earlier run finished,
records rows without a prompt as errors, and passes results to a `PartWriter` in completion order.
"""
from __future__ import annotations

import bisect
from typing import Any, Iterator

from batchinfer.engine.types import Request
from batchinfer.jobs.run.engine_io import output_result
from batchinfer.jobs.run.row_requests import RowRequests
from batchinfer.jobs.inputs.files import RowWindow, iter_windows
from batchinfer.jobs.outdir.part_writer import PartWriter, SampleResult
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.run.progress import ProgressReporter
from batchinfer.jobs.inputs.prompts import build_prompts


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


class WindowRun:
    """The mutable state of one run: writer, progress and open windows."""

    def __init__(self, job: PreparedJob, engine: Any, writer: PartWriter, progress: ProgressReporter,
                 done: dict[int, frozenset[int]], window_rows: int) -> None:
        self.job, self.engine, self.writer, self.progress, self.done = job, engine, writer, progress, done
        self.window_rows = window_rows
        self.windows = _OpenWindows()
        self.stops: dict[int, tuple[str, ...]] = {}  # row → its own stop strings (batch input), until its output
        self.rows = RowRequests(job)

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
                                    self.job.vocab_size, id_column=spec.id_column, max_chars=self.job.max_prompt_chars)
            columns = self.rows.columns(window.table)
            for offset, row in enumerate(rows):
                if not todo[row]:
                    continue
                yield from self.rows.for_row(columns, offset, row, prompts.token_ids[offset], prompts.errors[offset],
                                             todo[row], self.done.get(row), self.stops, self.record)

    def run(self) -> None:
        stops = self.job.spec.sampling.stop
        for output in self.engine.generate(self.requests()):
            result = output_result(output, self.job.tokenizer, self.stops.get(output.request_id, stops),
                                   self.job.reasoning, self.rows.scores)
            if result is not None:  # None: a scored row waiting for its other continuations
                self.record(result)

    @property
    def samples_written(self) -> int:
        return self.writer.rows_written

    @property
    def errors_written(self) -> int:
        return self.writer.error_rows_written
