"""Parquet input: find the files, check them, stream their rows in bounded windows.

Rows are never loaded all at once: `iter_windows` walks record batches file by file, so
memory is bounded by the window size whatever the input size. Each row gets a global
index (its position across the sorted files), which is its identity for resume.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.atomic_files import sha256_file
from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.input_glob import glob_files, has_glob, unique_files


@dataclass(frozen=True)
class InputFiles:
    paths: tuple[Path, ...]
    schema: pa.Schema
    num_rows: int  # all files together, before any limit
    table: Optional[pa.Table] = None  # rows held in memory (an OpenAI batch file, parsed): read from here


@dataclass(frozen=True)
class RowWindow:
    first_row: int   # global index of the table's first row
    table: pa.Table  # every input column of rows first_row .. first_row + num_rows - 1


def _matching_files(pattern: str, exclude: Optional[Path] = None) -> list[Path]:
    """Files of `pattern`, sorted, each real file once, leaving out every file under the folder `exclude`."""
    if has_glob(pattern):
        paths = glob_files(pattern)
    elif Path(pattern).is_dir():
        paths = unique_files(p for p in Path(pattern).glob("*.parquet") if p.is_file())
    else:
        paths = [Path(pattern)] if Path(pattern).is_file() else []
    if exclude is not None:
        excluded = exclude.resolve()
        paths = [p for p in paths if not p.resolve().is_relative_to(excluded)]
    return sorted(paths)


def open_inputs(pattern: str, job_file: Path, where: str, exclude: Optional[Path] = None) -> InputFiles:
    """Resolve `pattern` (file, folder or glob) and check every file is Parquet with one schema.

    Files under `exclude` (the job's own output folder) are never inputs: a glob such as
    `data/**/*.parquet` would otherwise read the job's earlier parts back in on every rerun.
    """
    paths = _matching_files(pattern, exclude)
    if not paths:
        if has_glob(pattern):
            what = "no files match"
        elif Path(pattern).is_dir():
            what = "folder has no .parquet files"
        else:
            what = "no such file or folder"
        if exclude is not None and _matching_files(pattern):
            what += f" outside the job's output folder {display_path(exclude)}"
        raise JobError(job_file, where, f"{what}: {display_path(pattern)}")
    schema: Optional[pa.Schema] = None
    num_rows = 0
    for path in paths:
        try:
            metadata = pq.ParquetFile(path).metadata
            file_schema = metadata.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as exc:
            raise JobError(job_file, where, f"{display_path(path)}: not a readable Parquet file ({exc})") from None
        # Pandas index metadata would make from_arrow round trips disagree on columns.
        file_schema = file_schema.remove_metadata()
        if schema is None:
            schema = file_schema
        elif not file_schema.equals(schema):
            raise JobError(job_file, where, f"{display_path(path)}: schema differs from {display_path(paths[0])}")
        num_rows += metadata.num_rows
    assert schema is not None
    return InputFiles(paths=tuple(paths), schema=schema, num_rows=num_rows)


def iter_windows(inputs: InputFiles, window_rows: int, limit: Optional[int] = None) -> Iterator[RowWindow]:
    """Yield the first `limit` rows (all when None) in windows of at most `window_rows` rows."""
    remaining = inputs.num_rows if limit is None else min(limit, inputs.num_rows)
    next_row = 0
    if inputs.table is not None:
        for first in range(0, remaining, window_rows):
            yield RowWindow(first_row=first, table=inputs.table.slice(first, min(window_rows, remaining - first)))
        return
    for path in inputs.paths:
        # pre_buffer off: with it Arrow keeps every range it has read, so RSS grows with the input.
        for batch in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=window_rows):
            if remaining <= 0:
                return
            batch = batch.slice(0, remaining)
            table = pa.Table.from_batches([batch]).replace_schema_metadata(None)
            yield RowWindow(first_row=next_row, table=table)
            next_row += batch.num_rows
            remaining -= batch.num_rows


def input_fingerprint(inputs: InputFiles) -> list[dict]:
    """What identifies the input's content: each file's name, size and sha256, in input order.

    A content hash sees any edit (a same-size edit of an uncompressed file included); it
    costs one read of the input per run (sha256 runs at about 1.2 GB/s on one core of the
    development machine, so reading from disk is usually the limit). The list is in row
    order, so an input that only gains files after its last one keeps a prefix of it.
    """
    return [{"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)} for path in inputs.paths]
