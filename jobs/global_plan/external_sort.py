"""External merge sort of (key, row_index, error) rows in bounded memory.

Rows are buffered until their keys reach `run_bytes`, sorted in memory by (key, row index)
and written as one Parquet run; the runs are then merged k ways, each streamed a batch at a
time, so memory holds one batch per open run whatever the input size. When there are more
runs than `fan_in`, passes merge them into fewer, longer runs first. Polars' streaming sort
was the library candidate, but it holds its whole input in memory (peak RSS grows with the
input), so it cannot sort an input larger than RAM.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

RUN_SCHEMA = pa.schema([("key", pa.binary()), ("row_index", pa.int64()), ("error", pa.string())])
SortedRow = tuple[bytes, int, Optional[str]]  # (key, row_index, error)


@dataclass(frozen=True)
class SortBudget:
    run_bytes: int = 256 << 20    # key bytes buffered before a run is sorted and written
    merge_bytes: int = 256 << 20  # read buffers of all the runs one merge streams at once
    fan_in: int = 64              # runs merged at once

    def __post_init__(self) -> None:
        if self.run_bytes < 1 or self.merge_bytes < 1 or self.fan_in < 2:
            raise ValueError("run_bytes and merge_bytes must be >= 1 and fan_in >= 2")

    @property
    def bytes_per_open_run(self) -> int:
        return max(1, self.merge_bytes // self.fan_in)


class _RunFile:
    """Writes already-sorted rows to one run file, in row groups a merge can stream."""

    def __init__(self, path: Path, group_bytes: int) -> None:
        self.path = path
        self.group_bytes = group_bytes
        self._writer = pq.ParquetWriter(path, RUN_SCHEMA, compression="none")
        self._keys: list[bytes] = []
        self._rows: list[int] = []
        self._errors: list[Optional[str]] = []
        self._bytes = 0

    def add(self, key: bytes, row_index: int, error: Optional[str]) -> None:
        self._keys.append(key)
        self._rows.append(row_index)
        self._errors.append(error)
        self._bytes += len(key) + 16
        if self._bytes >= self.group_bytes:
            self._write_group()

    def _write_group(self) -> None:
        if self._keys:
            self._writer.write_table(pa.table([pa.array(self._keys, pa.binary()), pa.array(self._rows, pa.int64()),
                                               pa.array(self._errors, pa.string())], schema=RUN_SCHEMA))
        self._keys, self._rows, self._errors, self._bytes = [], [], [], 0

    def close(self) -> Path:
        self._write_group()
        self._writer.close()
        return self.path


class RunWriter:
    """Collects rows in any order; writes a sorted run each time the buffered keys reach the budget."""

    def __init__(self, folder: Path, budget: SortBudget) -> None:
        self.folder = folder
        self.budget = budget
        folder.mkdir(parents=True, exist_ok=True)
        self.runs: list[Path] = []
        self._keys: list[bytes] = []
        self._rows: list[int] = []
        self._errors: list[Optional[str]] = []
        self._bytes = 0

    def add_many(self, row_indices: Sequence[int], keys: Sequence[bytes], errors: Sequence[Optional[str]]) -> None:
        self._rows.extend(row_indices)
        self._keys.extend(keys)
        self._errors.extend(errors)
        self._bytes += sum(map(len, keys)) + 16 * len(keys)
        if self._bytes >= self.budget.run_bytes:
            self._write_run()

    def _write_run(self) -> None:
        if not self._keys:
            return
        keys, rows, errors = self._keys, self._rows, self._errors
        order = sorted(range(len(keys)), key=list(zip(keys, rows)).__getitem__)
        run = _RunFile(self.folder / f"run-{len(self.runs):06d}.parquet", self.budget.bytes_per_open_run)
        for i in order:
            run.add(keys[i], rows[i], errors[i])
        self.runs.append(run.close())
        self._keys, self._rows, self._errors, self._bytes = [], [], [], 0

    def finish(self) -> list[Path]:
        self._write_run()
        return list(self.runs)


def _read_run(path: Path) -> Iterator[SortedRow]:
    """A run's rows in order, one row group (about `bytes_per_open_run`) in memory at a time."""
    parquet = pq.ParquetFile(path)
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group)
        yield from zip(table.column(0).to_pylist(), table.column(1).to_pylist(), table.column(2).to_pylist())


def _merged(runs: Sequence[Path]) -> Iterator[SortedRow]:
    if len(runs) == 1:
        return _read_run(runs[0])
    return heapq.merge(*(_read_run(path) for path in runs))


def merge_runs(runs: Iterable[Path], folder: Path, budget: SortBudget) -> Iterator[SortedRow]:
    """Every row of `runs` in (key, row_index) order. Runs are deleted once merged into a longer
    one; the last `fan_in` are streamed, not rewritten (the caller deletes `folder` after)."""
    runs = list(runs)
    level = 0
    while len(runs) > budget.fan_in:
        longer = []
        for start in range(0, len(runs), budget.fan_in):
            group = runs[start:start + budget.fan_in]
            if len(group) == 1:
                longer.append(group[0])
                continue
            run = _RunFile(folder / f"merge-{level:02d}-{start // budget.fan_in:06d}.parquet",
                           budget.bytes_per_open_run)
            for row in _merged(group):
                run.add(*row)
            longer.append(run.close())
            for path in group:
                path.unlink()
        runs = longer
        level += 1
    if runs:
        yield from _merged(runs)
