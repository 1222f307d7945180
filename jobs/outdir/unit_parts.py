"""A unit's parts: names and contents fixed by the unit, and what was done when the run started.

Unit u's rows, in plan order, are cut into chunks of `chunk_rows(flush_rows, n)` rows; chunk k's
samples that were not done when the run started go into `part-u<u>-<k>.parquet`, committed once
all of them are finished. So every attempt at a unit within one run writes the same pairs
under the same names (a unit run twice rewrites them, never duplicates a pair), and an attempt
skips a chunk whose part an earlier attempt already committed. The parent of the run writes
what was done at its start, by unit, into `_work/resume.parquet` (`write_done_index`) before any
unit runs; every worker reads its unit's share of it (`DoneIndex`).

A unit part left by an earlier plan of the same folder (the input grew, so the units changed)
would be rewritten by this plan's chunk of the same name: `retire_foreign_unit_parts` renames
such parts to numbered parts first, keeping their rows.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer.jobs.outdir.atomic_files import fsync_dir, write_atomically
from batchinfer.jobs.outdir.part_store import UNIT_PART_PATTERN, PartRecord, part_name, record_path, unit_part_name

RESUME_NAME = "resume.parquet"
_DONE_SCHEMA = pa.schema([("unit_id", pa.int32()), ("row_index", pa.int64()), ("sample_index", pa.int32())])
_DONE_GROUP_ROWS = 1 << 16  # sorted by unit: a unit's rows are read from a group or two


def chunk_rows(flush_rows: int, n: int) -> int:
    """Rows per unit part: at most `flush_rows` samples (one row when n alone exceeds it)."""
    return max(1, flush_rows // n)


def unit_part_committed(out_dir: Path, unit_id: int, chunk: int) -> bool:
    name = unit_part_name(unit_id, chunk)
    return (out_dir / name).is_file() and record_path(out_dir, name).is_file()


def write_done_index(work_dir: Path, row_units: np.ndarray, done: Mapping[int, Iterable[int]]) -> None:
    """(unit, row, sample) of every pair done at the run's start, sorted by unit (rows past the job's
    last row, e.g. a lowered limit, are left out)."""
    rows_out, samples_out = [], []
    for row, samples in done.items():
        if row < len(row_units):
            for sample in samples:
                rows_out.append(row)
                samples_out.append(sample)
    rows = np.asarray(rows_out, dtype=np.int64)
    samples = np.asarray(samples_out, dtype=np.int32)
    units = np.asarray(row_units[rows], dtype=np.int32) if len(rows) else np.zeros(0, dtype=np.int32)
    order = np.lexsort((samples, rows, units))
    table = pa.table([units[order], rows[order], samples[order]], schema=_DONE_SCHEMA)
    write_atomically(work_dir / RESUME_NAME,
                     lambda temp: pq.write_table(table, temp, row_group_size=_DONE_GROUP_ROWS))
    fsync_dir(work_dir)


class DoneIndex:
    """A unit's pairs done at the run's start, from `_work/resume.parquet` (none when it is absent)."""

    def __init__(self, work_dir: Path) -> None:
        path = Path(work_dir) / RESUME_NAME
        self._file: Optional[pq.ParquetFile] = pq.ParquetFile(path) if path.is_file() else None
        self._ranges: list[tuple[int, int]] = []
        if self._file is not None:
            metadata = self._file.metadata
            for group in range(metadata.num_row_groups):
                stats = metadata.row_group(group).column(0).statistics
                self._ranges.append((stats.min, stats.max) if stats is not None and stats.has_min_max
                                    else (-1, 1 << 31))

    def for_unit(self, unit_id: int) -> dict[int, frozenset[int]]:
        if self._file is None:
            return {}
        groups = [g for g, (low, high) in enumerate(self._ranges) if low <= unit_id <= high]
        if not groups:
            return {}
        table = self._file.read_row_groups(groups)
        table = table.filter(pc.equal(table["unit_id"], unit_id))
        done: dict[int, set[int]] = defaultdict(set)
        for row, sample in zip(table["row_index"].to_pylist(), table["sample_index"].to_pylist()):
            done[row].add(sample)
        return {row: frozenset(samples) for row, samples in done.items()}


def _retire(out_dir: Path, name: str, number: int) -> None:
    """Rename a part and its record to `part-<number>`: new record, rename, old record (crash-safe:
    a record without its part is a leftover the next start removes)."""
    record = PartRecord.read(record_path(out_dir, name))
    assert record is not None
    new_name = part_name(number)
    moved = PartRecord(name=new_name, bytes=record.bytes, rows=record.rows, sha256=record.sha256)
    write_atomically(record_path(out_dir, new_name), lambda temp: temp.write_text(moved.to_json(), encoding="utf-8"))
    os.replace(out_dir / name, out_dir / new_name)
    fsync_dir(out_dir)
    record_path(out_dir, name).unlink()


class PlannedUnitRows(Protocol):
    """What retiring needs of a `global_plan.WorkPlan` (the plan sits above the output folder)."""

    units: Sequence[Any]

    def read_unit(self, unit_id: int) -> Sequence[Any]: ...


def retire_foreign_unit_parts(out_dir: Path, plan: PlannedUnitRows, parts: Iterable[Path],
                              done: Mapping[int, frozenset[int]], n: int, flush_rows: int,
                              next_number: int) -> int:
    """Rename each unit part this plan would write again (its chunk has pairs not done) to a numbered
    part; → the next free part number. Call it holding the folder's lock, before units run."""
    per_chunk = chunk_rows(flush_rows, n)
    by_unit: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for path in parts:
        match = UNIT_PART_PATTERN.match(path.name)
        if match and int(match.group(1)) < len(plan.units):
            by_unit[int(match.group(1))].append((int(match.group(2)), path.name))
    for unit_id, chunks in sorted(by_unit.items()):
        rows = plan.read_unit(unit_id)
        for chunk, name in sorted(chunks):
            members = rows[chunk * per_chunk:(chunk + 1) * per_chunk]
            if any(len(done.get(row.row_index, ())) < n for row in members):
                _retire(out_dir, name, next_number)
                next_number += 1
    return next_number
