"""Output parts: finished samples, beside their input columns, buffered and committed as parts.

Each part is committed through `part_store.commit_part` (temporary dot-name, fsync, record
in `_parts/`, rename to `part-NNNNN.parquet`): a part, once it has its final name, is
complete and never rewritten, so downstream readers can consume parts as they appear and
resume can verify every part it finds against its record.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import pyarrow as pa

from batchinfer.jobs.outdir.atomic_files import TEMP_SUFFIX, write_atomically  # noqa: F401  (re-exported)
from batchinfer.jobs.outdir.interruption import commit_section
from batchinfer.jobs.outdir.part_store import PART_PATTERN, commit_part, part_name  # noqa: F401  (re-exported)
from batchinfer.jobs.outdir.valid_text import invalid_utf8_message, repair_table

ROW_INDEX_COLUMN = "row_index"
RESULT_SCHEMA = pa.schema([
    (ROW_INDEX_COLUMN, pa.int64()),       # the row's position in the input (resume key)
    ("sample_index", pa.int32()),
    ("generated_text", pa.string()),     # the answer: after the reasoning block when it is split off
    ("reasoning_text", pa.string()),     # the reasoning block's text; null: none, or not split (jobs/tasks/reasoning.py)
    ("reasoning_truncated", pa.bool_()),  # the output ended inside the reasoning; null when not split
    ("output_token_ids", pa.list_(pa.int32())),
    ("prompt_tokens", pa.int32()),
    ("cached_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("finish_reason", pa.string()),       # stop | length | error
    ("error", pa.string()),
])
RESULT_COLUMNS = tuple(RESULT_SCHEMA.names)

# Task columns, after the result columns when the job asks (`result_fields`).
TOKEN_LOGPROB_TYPE = pa.struct([
    ("logprob", pa.float32()),                # the generated token's, under the model's raw distribution
    ("top_ids", pa.list_(pa.int32())),        # the k most likely tokens (null with k = 0)
    ("top_logprobs", pa.list_(pa.float32())),
])
LOGPROBS_FIELD = pa.field("logprobs", pa.list_(TOKEN_LOGPROB_TYPE))  # one per output token
SCORE_FIELDS = (
    pa.field("continuation_logprobs", pa.list_(pa.float64())),  # summed logprob of each continuation
    pa.field("continuation_tokens", pa.list_(pa.int32())),      # its token count
    pa.field("continuation_greedy", pa.list_(pa.bool_())),      # whether greedy decoding gives it, token by token
)
TASK_COLUMNS = (LOGPROBS_FIELD.name,) + tuple(f.name for f in SCORE_FIELDS)


def result_fields(task, batch_input: bool = False) -> tuple[pa.Field, ...]:
    """The output columns of a job with `task` (a TaskSpec): the result columns, `logprobs`
    when the job (or, for an OpenAI batch input, any line) may ask, the score columns for task score."""
    fields = tuple(RESULT_SCHEMA)
    if task.logprobs is not None or batch_input:
        fields += (LOGPROBS_FIELD,)
    if task.task == "score":
        fields += SCORE_FIELDS
    return fields


def job_result_fields(spec) -> tuple[pa.Field, ...]:
    """`result_fields` of a JobSpec."""
    from batchinfer.jobs.spec.job_file import openai_batch_input

    return result_fields(spec.task, openai_batch_input(spec))


def append_results(table: pa.Table, results: list["SampleResult"], fields: tuple[pa.Field, ...]) -> pa.Table:
    """`table` (one input row per result) with the results' columns appended.

    Every part's rows pass here, so this is where the output is made readable: input text that is
    not valid UTF-8 is written with U+FFFD in place of its invalid bytes, and a row changed so says
    it in its `error` (unless it has one already; its generation, if any, stands)."""
    table, changed = repair_table(table)
    if changed:
        results = [replace(r, error=invalid_utf8_message(changed[row])) if row in changed and r.error is None else r
                   for row, r in enumerate(results)]
    for f in fields:
        table = table.append_column(f, pa.array([getattr(r, f.name) for r in results], type=f.type))
    return table


@dataclass(frozen=True)
class SampleResult:
    """One finished (row, sample): the output columns of one output row."""

    row_index: int
    sample_index: int
    generated_text: str
    output_token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    error: Optional[str] = None
    reasoning_text: Optional[str] = None
    reasoning_truncated: Optional[bool] = None
    logprobs: Optional[list[dict]] = None   # TOKEN_LOGPROB_TYPE rows, one per output token
    continuation_logprobs: Optional[list[float]] = None
    continuation_tokens: Optional[list[int]] = None
    continuation_greedy: Optional[list[bool]] = None


class PartWriter:
    """Buffers finished samples with their input rows and writes them as parts.

    Input rows are held as (window table, row offset) references until the flush, so a
    buffered sample costs a few ints, not a copy of its (possibly long) input columns.
    `before_commit` runs before each part is committed (the runner checks it still holds
    the folder's lock); the counters count only what is committed, i.e. on disk.
    """

    def __init__(self, out_dir: Path, flush_rows: int, next_part: int, flush_seconds: float = 60.0,
                 before_commit: Callable[[], None] = lambda: None,
                 finish_table: Callable[[pa.Table], pa.Table] = lambda table: table,
                 fields: tuple[pa.Field, ...] = tuple(RESULT_SCHEMA)) -> None:
        self.out_dir = out_dir
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.next_part = next_part
        self.before_commit = before_commit
        self.finish_table = finish_table  # e.g. the eval's `correct` column, from the part's own columns
        self.fields = fields              # the output columns (result_fields)
        self.parts_written = 0
        self.rows_written = 0        # samples in committed parts
        self.error_rows_written = 0  # of those, finish_reason "error"
        self._pending: list[tuple[pa.Table, int, SampleResult]] = []
        self._last_flush = time.monotonic()

    def add(self, window_table: pa.Table, offset: int, result: SampleResult) -> None:
        self._pending.append((window_table, offset, result))
        # Flush on time too, so a slow job still puts finished work on disk regularly.
        if len(self._pending) >= self.flush_rows or time.monotonic() - self._last_flush > self.flush_seconds:
            self.flush()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self) -> Optional[Path]:
        self._last_flush = time.monotonic()
        if not self._pending:
            return None
        name = part_name(self.next_part)
        table = self.finish_table(self._build_table(self._pending, self.fields))
        commit_results(self.out_dir, name, table, self.before_commit, self._count)
        return self.out_dir / name

    def _count(self) -> None:
        self.rows_written += len(self._pending)
        self.error_rows_written += sum(result.finish_reason == "error" for _, _, result in self._pending)
        self._pending = []
        self.next_part += 1
        self.parts_written += 1

    @staticmethod
    def _build_table(pending: list[tuple[pa.Table, int, SampleResult]], fields: tuple[pa.Field, ...]) -> pa.Table:
        # Take each window's rows in one gather, keeping the samples' order within a window.
        by_window: dict[int, tuple[pa.Table, list[int], list[SampleResult]]] = {}
        for window_table, offset, result in pending:
            entry = by_window.setdefault(id(window_table), (window_table, [], []))
            entry[1].append(offset)
            entry[2].append(result)
        pieces = []
        for window_table, offsets, results in by_window.values():
            inputs = window_table.take(pa.array(offsets, type=pa.int64()))
            pieces.append(append_results(inputs, results, fields))
        return pa.concat_tables(pieces)


def commit_results(out_dir: Path, name: str, table: pa.Table, before_commit: Callable[[], None],
                   count: Callable[[], None]) -> None:
    """The one place a part of samples is committed (PartWriter's numbered parts, the unit runner's unit
    parts): written, fsynced, recorded, renamed and counted (`count`) in one commit section, so it is
    on disk and counted, or neither (a stop signal waits for the end). `before_commit`: e.g. the lock."""
    with commit_section():
        before_commit()
        commit_part(out_dir, name, table)
        count()
