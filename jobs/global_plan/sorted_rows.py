"""The globally sorted rows on disk: written once from the merge, read by range and by profile.

`sorted.parquet` holds every row in (key, row_index) order with its longest common prefix
with the row before (`lcp`) and its prompt length (`tokens`, 0 for an error row), in row
groups of `row_group_rows_for(rows)`. Units are contiguous ranges of this order, so reading one
touches only the row groups that overlap it, and the cutting passes read just the two
small integer columns.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.global_plan.external_sort import SortedRow
from batchinfer.jobs.global_plan.keys import common_prefix_tokens, decode_key, key_tokens

SORTED_SCHEMA = pa.schema([
    ("row_index", pa.int64()),
    ("key", pa.binary()),      # prompt token ids as big-endian uint32; empty for an error row
    ("error", pa.string()),    # why the row has no prompt (null for a prompt row)
    ("lcp", pa.int32()),       # tokens shared with the previous row in this order
    ("tokens", pa.int32()),    # prompt length
])
ROW_GROUP_ROWS = 1024   # rows per row group, until ...
MAX_ROW_GROUPS = 8192   # ... the footer (read by every worker) would describe more row groups than this


def row_group_rows_for(rows: int) -> int:
    return max(ROW_GROUP_ROWS, -(-rows // MAX_ROW_GROUPS))


@dataclass(frozen=True)
class SpillTotals:
    """What the sorted rows hold, independent of sampling."""

    rows: int
    error_rows: int
    prompt_tokens: int         # Σ prompt lengths (one sample each)
    first_sample_reuse: int    # Σ min(lcp, len - 1): the global ideal with one sample
    further_sample_reuse: int  # Σ (len - 1): what each further sample of every prompt reuses

    @property
    def prompt_rows(self) -> int:
        return self.rows - self.error_rows

    def ideal_cached_tokens(self, n: int) -> int:
        """Σ over the globally sorted prompts (n samples as n identical rows) of min(lcp, len - 1)."""
        return self.first_sample_reuse + (n - 1) * self.further_sample_reuse if n else 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class UnitRow:
    """One row of a unit, in plan order: a prompt to run, or the reason it has none."""

    row_index: int
    token_ids: Optional[list[int]]
    error: Optional[str]


def write_sorted_rows(rows: Iterable[SortedRow], path: Path, on_rows: Optional[Callable[[int], None]] = None,
                      row_group_rows: int = ROW_GROUP_ROWS, restart_every: Optional[int] = None) -> SpillTotals:
    """Write the merged stream with each row's lcp and length; returns the totals. `restart_every`: rows at
    multiples of it share nothing with the row before (a window plan's units, planned alone)."""
    totals = dict(rows=0, error_rows=0, prompt_tokens=0, first_sample_reuse=0, further_sample_reuse=0)
    columns: tuple[list, ...] = ([], [], [], [], [])
    previous = b""

    def write_group() -> None:
        writer.write_table(pa.table([pa.array(column, field.type) for column, field in zip(columns, SORTED_SCHEMA)],
                                    schema=SORTED_SCHEMA))
        if on_rows is not None:
            on_rows(len(columns[0]))
        for column in columns:
            column.clear()

    with pq.ParquetWriter(path, SORTED_SCHEMA, compression="zstd", compression_level=1) as writer:
        for key, row_index, error in rows:
            tokens = key_tokens(key)
            restart = restart_every is not None and totals["rows"] % restart_every == 0
            lcp = common_prefix_tokens(previous, key) if tokens and previous and not restart else 0
            previous = key
            totals["rows"] += 1
            if error is not None:
                totals["error_rows"] += 1
            else:
                totals["prompt_tokens"] += tokens
                totals["first_sample_reuse"] += max(0, min(lcp, tokens - 1))
                totals["further_sample_reuse"] += max(0, tokens - 1)
            for column, value in zip(columns, (row_index, key, error, lcp, tokens)):
                column.append(value)
            if len(columns[0]) >= row_group_rows:
                write_group()
        if columns[0] or totals["rows"] == 0:
            write_group()
    return SpillTotals(**totals)


def iter_profile(path: Path) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(lcp, tokens) of every row in sorted order, one row group at a time (int64 arrays)."""
    parquet = pq.ParquetFile(path)
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group, columns=["lcp", "tokens"])
        if table.num_rows:
            yield (table.column(0).to_numpy().astype(np.int64), table.column(1).to_numpy().astype(np.int64))


class SortedRowsReader:
    """Reads ranges of the sorted rows; opens the file on first use (so it can travel to a worker)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: Optional[pq.ParquetFile] = None
        self._group_starts: Optional[np.ndarray] = None

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def _open(self) -> tuple[pq.ParquetFile, np.ndarray]:
        if self._file is None:
            self._file = pq.ParquetFile(self.path)
            metadata = self._file.metadata
            counts = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            self._group_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        assert self._group_starts is not None
        return self._file, self._group_starts

    @property
    def num_rows(self) -> int:
        return int(self._open()[1][-1])

    def read(self, start: int, count: int) -> list[UnitRow]:
        """Rows start .. start + count - 1 of the sorted order."""
        parquet, starts = self._open()
        if count <= 0:
            return []
        if start < 0 or start + count > starts[-1]:
            raise IndexError(f"rows {start}..{start + count - 1} are outside the {int(starts[-1])} sorted rows")
        first = int(np.searchsorted(starts, start, side="right")) - 1
        last = int(np.searchsorted(starts, start + count - 1, side="right")) - 1
        table = parquet.read_row_groups(list(range(first, last + 1)), columns=["row_index", "key", "error"])
        table = table.slice(start - int(starts[first]), count)
        return [UnitRow(row_index, None if error is not None else decode_key(key), error)
                for row_index, key, error in zip(table.column(0).to_pylist(), table.column(1).to_pylist(),
                                                  table.column(2).to_pylist())]
