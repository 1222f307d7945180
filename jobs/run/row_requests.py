"""The one place input rows become engine requests, for the unit runner and the window arm alike.

    rows = RowRequests(job)                      # per run: the score and grammar state of its rows
    columns = rows.columns(table)                # per table of rows: ids, per-row sampling, cells, schemas
    requests = rows.for_row(columns, offset, row_index, token_ids, error, todo, done, stops, record)

A row without a prompt, a score row without continuations and a row whose schema does not compile
are passed to `record` as error results and never reach the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import pyarrow as pa

from batchinfer.engine.types import Request
from batchinfer.jobs.formats.openai_batch import row_sampling
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.inputs.prompts import row_ids
from batchinfer.jobs.outdir.part_writer import SampleResult
from batchinfer.jobs.outdir.valid_text import valid_cells
from batchinfer.jobs.run.engine_io import error_result, row_request, seed_key
from batchinfer.jobs.tasks.grammar_rows import RowGrammars
from batchinfer.jobs.tasks.scoring import ScoreRows, row_score_requests


@dataclass(frozen=True)
class RowColumns:
    """What the requests of one table's rows read besides their prompts."""

    ids: Optional[list]                 # id_column values; None without one
    per_row: Optional[list]             # per-row sampling (batch input); None: the job's for every row
    cells: Optional[list]               # score continuations; None unless task score
    schemas: Optional[list]             # per-row JSON schemas; None without a schema column
    cell_errors: dict[int, str]         # offset → why its continuations / schema cell cannot be read


class RowRequests:
    def __init__(self, job: PreparedJob) -> None:
        self.job = job
        self.scores = ScoreRows()  # task score: a row's continuations until the last is back
        self.grammars = RowGrammars(job.spec, job.tokenizer, job.vocab_size)

    def columns(self, table: pa.Table) -> RowColumns:
        spec = self.job.spec
        cells = schemas = None
        cell_errors: dict[int, str] = {}
        if spec.task.task == "score":
            column = spec.task.continuations_column
            cells, cell_errors = valid_cells(table[column], column)
        if self.grammars.column is not None:
            schemas, schema_errors = valid_cells(table[self.grammars.column], self.grammars.column)
            cell_errors = {**schema_errors, **cell_errors}
        return RowColumns(ids=row_ids(table, spec.id_column) if spec.id_column else None,
                          per_row=row_sampling(spec, table), cells=cells, schemas=schemas, cell_errors=cell_errors)

    def for_row(self, columns: RowColumns, offset: int, row_index: int, token_ids: Any, error: Optional[str],
                todo: Sequence[int], done: Optional[frozenset[int]], stops: dict[int, tuple[str, ...]],
                record: Callable[[SampleResult], None]) -> list[Request]:
        """The requests of the row at `offset` of the table (its samples `todo`; `done` ones skipped)."""
        spec = self.job.spec
        error = error or columns.cell_errors.get(offset)
        if error is not None:
            for sample in todo:
                record(error_result(row_index, sample, error))
            return []
        row_id = columns.ids[offset] if columns.ids is not None else None
        sampling = columns.per_row[offset] if columns.per_row is not None else spec.sampling
        if columns.per_row is not None:
            stops[row_index] = sampling.stop
        if columns.cells is not None:
            requests, error = row_score_requests(self.job.tokenizer, row_index, token_ids, columns.cells[offset],
                                                 seed_key(row_index, row_id))
            if error is not None:
                record(error_result(row_index, 0, error))
                return []
            self.scores.expect(row_index, len(requests))
            return list(requests)
        grammar, error = self.grammars.for_row(columns.schemas[offset] if columns.schemas else None)
        if error is not None:
            for sample in todo:
                record(error_result(row_index, sample, error))
            return []
        return [row_request(row_index, token_ids, sampling, row_id, done, grammar)]
