"""Each work unit's input columns, bucketed on disk so that a unit reads only its own rows.

A unit's rows are scattered over the input (that is why the job was sorted), so reading them
from the input would read the whole input per unit. Right after the units are cut, one
streaming pass over the input writes every row's input columns into buckets instead:

    <work>/inputs-<units digest[:16]>/
        row_units.npy          the unit of every input row (int32, memory-mapped: 4 bytes a row)
        bucket-NNNNN.parquet   the rows of a range of units, sorted by (unit, row_index), with row
                               groups cut at unit boundaries (a unit, or a few small ones, per group)
        inputs.json            the commit record, written last: the units digest, bucket ranges and
                               each file's checksum (size, sha256), verified before the files are reused

Pass 1 streams input windows, splits each window's rows by bucket and appends them to one
Arrow IPC file per bucket, holding at most `spill_bytes` in memory. Pass 2 reads one bucket
at a time (at most about `bucket_bytes`), sorts it by unit and writes its Parquet file. A
unit's rows are then a contiguous range of one bucket, found from the units' row counts. A
kill at any point leaves no record, and the next build starts the folder again; a file that
differs from its checksum (torn, damaged) makes the run build the folder again, with a note.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.outdir.atomic_files import checksum_problem, file_checksum, fsync_dir, write_atomically
from batchinfer.jobs.errors import display_path
from batchinfer.jobs.global_plan.store import SORTED_NAME, WorkPlan
from batchinfer.jobs.inputs.files import iter_windows, open_input
from batchinfer.jobs.outdir.part_writer import ROW_INDEX_COLUMN
from batchinfer.jobs.inputs.prepared_job import PreparedJob

RECORD_NAME = "inputs.json"
ROW_UNITS_NAME = "row_units.npy"
FORMAT = 2  # 2: file checksums in the record
BUCKET_BYTES = 64 << 20    # input bytes a bucket holds (pass 2 holds one, and its sorted copy)
SPILL_BYTES = 32 << 20     # rows buffered in pass 1 before they go to their bucket files
GROUP_ROWS = 1024          # a row group closes at the first unit boundary past this many rows
WINDOW_ROWS = 8192         # input rows read at a time


def inputs_dir_for(plan: WorkPlan) -> Path:
    return plan.work_dir / f"inputs-{plan.units_digest[:16]}"


@dataclass(frozen=True)
class BucketLayout:
    first_units: tuple[int, ...]   # first unit id of each bucket, ascending, starting at 0

    def bucket_of(self, unit_id: int) -> int:
        return int(np.searchsorted(np.asarray(self.first_units), unit_id, side="right")) - 1


def plan_buckets(unit_rows: list[int], row_bytes: float, bucket_bytes: int) -> BucketLayout:
    """Consecutive units per bucket, each bucket at most `bucket_bytes` (at least one unit)."""
    first, size = [0] if unit_rows else [], 0.0
    for unit_id, rows in enumerate(unit_rows):
        if size and size + rows * row_bytes > bucket_bytes:
            first.append(unit_id)
            size = 0.0
        size += rows * row_bytes
    return BucketLayout(tuple(first))


def _row_bytes(job: PreparedJob) -> float:
    """Average uncompressed bytes of an input row, from the Parquet footers."""
    total_bytes = total_rows = 0
    if job.inputs.table is not None:  # rows held in memory (an OpenAI batch file)
        return max(job.inputs.table.nbytes / max(job.inputs.table.num_rows, 1), 1.0)
    for index in range(len(job.inputs.paths)):
        with open_input(job.inputs, index) as parquet:  # the file the job started with, or a one-line error
            metadata = parquet.metadata
        total_rows += metadata.num_rows
        total_bytes += sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
    return max(total_bytes / total_rows, 1.0) if total_rows else 1.0


def _write_row_units(plan: WorkPlan, rows: int, path: Path) -> np.ndarray:
    """unit of row, for every input row: from the sorted rows (each unit a range of sorted positions)."""
    row_units = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(rows,)) if rows else \
        np.zeros(0, dtype=np.int32)
    starts = np.asarray([unit.start for unit in plan.units], dtype=np.int64)
    parquet = pq.ParquetFile(plan.work_dir / SORTED_NAME)
    position = 0
    for group in range(parquet.num_row_groups):
        row_index = parquet.read_row_group(group, columns=[ROW_INDEX_COLUMN]).column(0).to_numpy()
        positions = np.arange(position, position + len(row_index))
        row_units[row_index] = np.searchsorted(starts, positions, side="right") - 1
        position += len(row_index)
    if rows:
        row_units.flush()
    return row_units


class _BucketSpill:
    """Pass 1: rows appended to one IPC stream file per bucket, through a bounded buffer."""

    def __init__(self, folder: Path, schema: pa.Schema, spill_bytes: int) -> None:
        self.folder, self.schema, self.spill_bytes = folder, schema, spill_bytes
        self._writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
        self._buffer: dict[int, list[pa.Table]] = {}
        self._buffered = 0

    def path(self, bucket: int) -> Path:
        return self.folder / f"bucket-{bucket:05d}.arrow"

    def add(self, bucket: int, table: pa.Table) -> None:
        self._buffer.setdefault(bucket, []).append(table)
        self._buffered += table.nbytes
        if self._buffered >= self.spill_bytes:
            self.flush()

    def flush(self) -> None:
        for bucket, tables in self._buffer.items():
            writer = self._writers.get(bucket)
            if writer is None:
                writer = self._writers[bucket] = pa.ipc.new_stream(str(self.path(bucket)), self.schema)
            writer.write_table(pa.concat_tables(tables).combine_chunks())
        self._buffer, self._buffered = {}, 0

    def close(self) -> None:
        self.flush()
        for writer in self._writers.values():
            writer.close()


def _spill_rows(job: PreparedJob, row_units: np.ndarray, bucket_of_unit: np.ndarray, spill: _BucketSpill,
                on_rows: Optional[Callable[[int], None]]) -> None:
    for window in iter_windows(job.inputs, WINDOW_ROWS, job.spec.limit):
        count = window.table.num_rows
        rows = np.arange(window.first_row, window.first_row + count, dtype=np.int64)
        buckets = bucket_of_unit[row_units[window.first_row:window.first_row + count]]
        order = np.argsort(buckets, kind="stable")
        table = window.table.append_column(ROW_INDEX_COLUMN, pa.array(rows)).take(pa.array(order))
        sorted_buckets = buckets[order]
        edges = np.flatnonzero(np.diff(sorted_buckets)) + 1
        for start, stop in zip(np.concatenate([[0], edges]), np.concatenate([edges, [count]])):
            spill.add(int(sorted_buckets[start]), table.slice(int(start), int(stop - start)))
        if on_rows is not None:
            on_rows(count)


def _write_bucket(spilled: Path, row_units: np.ndarray, target: Path, group_rows: int) -> None:
    """Pass 2 for one bucket: sort its rows by (unit, row_index), row groups at unit boundaries."""
    with pa.ipc.open_stream(str(spilled)) as reader:
        table = reader.read_all()
    rows = table[ROW_INDEX_COLUMN].to_numpy()
    units = row_units[rows]
    order = np.lexsort((rows, units))
    table, units = table.take(pa.array(order)), units[order]
    boundaries = np.flatnonzero(np.diff(units)) + 1  # where a new unit starts
    with pq.ParquetWriter(target, table.schema, compression="zstd", compression_level=1) as writer:
        start = 0
        while start < table.num_rows:
            past = boundaries[boundaries >= start + group_rows]
            stop = int(past[0]) if len(past) else table.num_rows
            writer.write_table(table.slice(start, stop - start), row_group_size=stop - start)
            start = stop


def build_unit_inputs(job: PreparedJob, plan: WorkPlan, on_rows: Optional[Callable[[int], None]] = None,
                      bucket_bytes: int = BUCKET_BYTES, spill_bytes: int = SPILL_BYTES,
                      group_rows: int = GROUP_ROWS, warn: Callable[[str], None] = lambda message: None) -> "UnitInputs":
    """The plan's unit inputs: reused when committed for these units and intact, else built (one input pass)."""
    folder = inputs_dir_for(plan)
    for stale in plan.work_dir.glob("inputs-*"):  # made for other units (config or sampling changed)
        if stale != folder:
            shutil.rmtree(stale, ignore_errors=True)
    existing = UnitInputs.open(plan, verify=True, warn=warn)
    if existing is not None:
        return existing
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    layout = plan_buckets([unit.rows for unit in plan.units], _row_bytes(job), bucket_bytes)
    row_units = _write_row_units(plan, job.rows, folder / ROW_UNITS_NAME)
    bucket_of_unit = np.zeros(len(plan.units), dtype=np.int32)
    for bucket, first in enumerate(layout.first_units):
        bucket_of_unit[first:] = bucket
    schema = job.inputs.schema.append(pa.field(ROW_INDEX_COLUMN, pa.int64()))
    spill = _BucketSpill(folder, schema, spill_bytes)
    try:
        _spill_rows(job, row_units, bucket_of_unit, spill, on_rows)
    finally:
        spill.close()
    for bucket in range(len(layout.first_units)):
        spilled = spill.path(bucket)
        target = folder / f"bucket-{bucket:05d}.parquet"
        if spilled.exists():
            _write_bucket(spilled, row_units, target, group_rows)
            spilled.unlink()
        else:  # every unit of the bucket is empty: an empty file keeps the layout simple
            pq.write_table(schema.empty_table(), target)
    files = [ROW_UNITS_NAME] if job.rows else []
    files += [f"bucket-{bucket:05d}.parquet" for bucket in range(len(layout.first_units))]
    record = {"format": FORMAT, "units_sha256": plan.units_digest, "rows": job.rows,
              "bucket_first_units": list(layout.first_units),
              "files": {name: file_checksum(folder / name) for name in files}}
    write_atomically(folder / RECORD_NAME, lambda temp: temp.write_text(json.dumps(record), encoding="utf-8"))
    fsync_dir(folder)
    opened = UnitInputs.open(plan)
    assert opened is not None
    return opened


class UnitInputs:
    """Reads a unit's input rows (every input column, plus row_index), sorted by row_index."""

    def __init__(self, plan: WorkPlan, folder: Path, layout: BucketLayout) -> None:
        self.folder, self.layout = folder, layout
        rows = np.asarray([unit.rows for unit in plan.units], dtype=np.int64)
        self._unit_rows = rows
        self._offsets = np.zeros(len(rows), dtype=np.int64)  # a unit's first row inside its bucket
        for bucket, first in enumerate(layout.first_units):
            stop = layout.first_units[bucket + 1] if bucket + 1 < len(layout.first_units) else len(rows)
            self._offsets[first:stop] = np.concatenate([[0], np.cumsum(rows[first:stop])[:-1]])
        self._files: dict[int, tuple[pq.ParquetFile, np.ndarray]] = {}

    @classmethod
    def open(cls, plan: WorkPlan, verify: bool = False,
             warn: Callable[[str], None] = lambda message: None) -> Optional["UnitInputs"]:
        """The committed inputs of the plan's units; None when there are none (or for other units), or,
        with `verify` (the run's parent, before reuse), when a file differs from its checksum (`warn`ed)."""
        folder = inputs_dir_for(plan)
        try:
            record = json.loads((folder / RECORD_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("format") != FORMAT or \
                record.get("units_sha256") != plan.units_digest:
            return None
        for name, checksum in (record.get("files") or {}).items() if verify else ():
            problem = checksum_problem(folder / name, checksum)
            if problem is not None:
                warn(f"{display_path(folder / name)}: damaged ({problem}); bucketing the unit inputs again "
                     "(finished parts are kept)")
                return None
        return cls(plan, folder, BucketLayout(tuple(record["bucket_first_units"])))

    def _bucket(self, bucket: int) -> tuple[pq.ParquetFile, np.ndarray]:
        if bucket not in self._files:
            parquet = pq.ParquetFile(self.folder / f"bucket-{bucket:05d}.parquet")
            metadata = parquet.metadata
            counts = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            self._files[bucket] = (parquet, np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]))
        return self._files[bucket]

    def read(self, unit_id: int) -> pa.Table:
        rows, start = int(self._unit_rows[unit_id]), int(self._offsets[unit_id])
        parquet, starts = self._bucket(self.layout.bucket_of(unit_id))
        if rows == 0:
            return parquet.schema_arrow.empty_table()
        first = int(np.searchsorted(starts, start, side="right")) - 1
        last = int(np.searchsorted(starts, start + rows - 1, side="right")) - 1
        table = parquet.read_row_groups(list(range(first, last + 1)))
        return table.slice(start - int(starts[first]), rows)
