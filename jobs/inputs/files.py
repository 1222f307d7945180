"""Parquet input: find the files, check them, stream their rows in bounded windows.
(Other formats are converted to Parquet first: `readers.py`.)

Rows are never loaded all at once: `iter_windows` walks record batches file by file, so
memory is bounded by the window size whatever the input size. Each row gets a global
index (its position across the sorted files), which is its identity for resume.

Every read goes through `open_input`, which checks that the file is still the one the job
started with (`InputStamp`: device, inode, size, mtime_ns, taken when its schema was read and
checked again around its hash): a file replaced (`mv` onto it) or rewritten during a run is
a one-line error, never rows of two versions in one job.
"""
from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.outdir.atomic_files import HASH_CHUNK_BYTES, sha256_file
from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.inputs.input_glob import glob_files, has_glob, unique_files
from batchinfer.jobs.inputs.remote import fetch_inputs
from batchinfer.jobs.spec.urls import is_url
from batchinfer.jobs.inputs.readers import convert_input, format_of, is_hf_dataset


@dataclass(frozen=True)
class InputStamp:
    """Which file a path named when the job started: any replacement or write in place changes it."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, handle: BinaryIO) -> "InputStamp":
        stat = os.fstat(handle.fileno())
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@dataclass(frozen=True)
class InputFiles:
    paths: tuple[Path, ...]
    schema: pa.Schema
    num_rows: int  # all files together, before any limit
    table: Optional[pa.Table] = None  # rows held in memory (an OpenAI batch file, parsed): read from here
    stamps: tuple[InputStamp, ...] = ()  # one per path, taken when its schema was read
    # the user's files when `paths` are their Parquet conversions (readers.py): what the fingerprint records
    sources: tuple[dict, ...] = ()
    job_file: Path = Path("jobs.yaml")   # for the error when a file changed during the run
    where: str = "input"


def _changed(inputs: InputFiles, path: Path, what: str) -> JobError:
    return JobError(inputs.job_file, inputs.where, f"{display_path(path)} {what} since the job started "
                                                   "(replaced or written to); rerun once the input is final")


@contextmanager
def _checked_handle(inputs: InputFiles, index: int) -> Iterator[BinaryIO]:
    """Input file `index` opened, checked to be the file the job started with, before and after use."""
    path, stamp = inputs.paths[index], inputs.stamps[index]
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise _changed(inputs, path, f"cannot be opened ({exc.strerror or exc})") from None
    with handle:
        if InputStamp.of(handle) != stamp:
            raise _changed(inputs, path, "changed")
        yield handle
        if InputStamp.of(handle) != stamp:  # written in place while it was read
            raise _changed(inputs, path, "changed")


@contextmanager
def open_input(inputs: InputFiles, index: int) -> Iterator[pq.ParquetFile]:
    """Input file `index` as Parquet, through `_checked_handle`: every read of an input goes here."""
    with _checked_handle(inputs, index) as handle:
        # pre_buffer off: with it Arrow keeps every range it has read, so RSS grows with the input.
        yield pq.ParquetFile(handle, pre_buffer=False)


@dataclass(frozen=True)
class RowWindow:
    first_row: int   # global index of the table's first row
    table: pa.Table  # every input column of rows first_row .. first_row + num_rows - 1


def _matching_files(pattern: str, exclude: Optional[Path] = None) -> list[Path]:
    """Files of `pattern`, sorted, each real file once, leaving out every file under the folder `exclude`."""
    if has_glob(pattern):
        paths = glob_files(pattern)
    elif is_hf_dataset(Path(pattern)):
        paths = [Path(pattern)]
    elif Path(pattern).is_dir():
        paths = unique_files(p for p in Path(pattern).glob("*.parquet") if p.is_file())
    else:
        paths = [Path(pattern)] if Path(pattern).is_file() else []
    if exclude is not None:
        excluded = exclude.resolve()
        paths = [p for p in paths if not p.resolve().is_relative_to(excluded)]
    return sorted(paths)


def open_inputs(pattern: str, job_file: Path, where: str, exclude: Optional[Path] = None,
                input_format: str = "auto") -> InputFiles:
    """Resolve `pattern` (file, folder, glob, or an object-store URL: remote.py) and check every file is
    Parquet with one schema.

    Files under `exclude` (the job's own output folder) are never inputs: a glob such as
    `data/**/*.parquet` would otherwise read the job's earlier parts back in on every rerun.
    Other formats (`input_format`, or by name: readers.py) are converted to Parquet first.
    """
    if is_url(pattern):
        copies = fetch_inputs(pattern, job_file, where)
        try:
            return _open_paths(list(copies), job_file, where, input_format)
        except JobError as exc:  # name the objects, not their local copies
            what = exc.what
            for copy, url in copies.items():
                what = what.replace(display_path(copy), url)
            raise JobError(job_file, where, what) from None
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
    return _open_paths(paths, job_file, where, input_format)


def _open_paths(paths: list[Path], job_file: Path, where: str, input_format: str) -> InputFiles:
    """`paths` converted to Parquet where they are another format, checked to share one schema."""
    sources: list[dict] = []
    formats = [format_of(path, input_format) for path in paths]
    if any(fmt != "parquet" for fmt in formats):
        converted = []
        for path, fmt in zip(paths, formats):
            if fmt == "parquet":
                raise JobError(job_file, where, f"{display_path(path)}: a Parquet file among inputs of another "
                                                "format; give one format per job")
            target, entries = convert_input(path, fmt, job_file, where)
            converted.append(target)
            sources.extend(entries)
        paths = converted
    schema: Optional[pa.Schema] = None
    num_rows = 0
    stamps = []
    for path in paths:
        try:
            with open(path, "rb") as handle:
                stamps.append(InputStamp.of(handle))
                metadata = pq.ParquetFile(handle).metadata
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
    return InputFiles(paths=tuple(paths), schema=schema, num_rows=num_rows, stamps=tuple(stamps),
                      sources=tuple(sources), job_file=job_file, where=where)


def iter_windows(inputs: InputFiles, window_rows: int, limit: Optional[int] = None) -> Iterator[RowWindow]:
    """Yield the first `limit` rows (all when None) in windows of at most `window_rows` rows."""
    remaining = inputs.num_rows if limit is None else min(limit, inputs.num_rows)
    next_row = 0
    if inputs.table is not None:
        for first in range(0, remaining, window_rows):
            yield RowWindow(first_row=first, table=inputs.table.slice(first, min(window_rows, remaining - first)))
        return
    for index in range(len(inputs.paths)):
        if remaining <= 0:
            return
        with open_input(inputs, index) as parquet:
            for batch in parquet.iter_batches(batch_size=window_rows):
                batch = batch.slice(0, remaining)
                table = pa.Table.from_batches([batch]).replace_schema_metadata(None)
                yield RowWindow(first_row=next_row, table=table)
                next_row += batch.num_rows
                remaining -= batch.num_rows
                if remaining <= 0:
                    break


def input_fingerprint(inputs: InputFiles) -> list[dict]:
    """What identifies the input's content: each file's name, size and sha256, in input order.

    A content hash sees any edit (a same-size edit of an uncompressed file included); it
    costs one read of the input per run (sha256 runs at about 1.2 GB/s on one core of the
    development machine, so reading from disk is usually the limit). The list is in row
    order, so an input that only gains files after its last one keeps a prefix of it. Each
    file is hashed through a handle checked against its stamp before and after, so the hash
    is of the very file every later read checks for.
    """
    if inputs.sources:  # converted inputs: the user's files, hashed when they were converted
        return [dict(entry) for entry in inputs.sources]
    if not inputs.stamps:  # rows parsed into memory when the job was prepared
        return [{"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)} for path in inputs.paths]
    fingerprint = []
    for index, (path, stamp) in enumerate(zip(inputs.paths, inputs.stamps)):
        digest = hashlib.sha256()
        with _checked_handle(inputs, index) as handle:
            while chunk := handle.read(HASH_CHUNK_BYTES):
                digest.update(chunk)
        fingerprint.append({"file": path.name, "bytes": stamp.size, "sha256": digest.hexdigest()})
    return fingerprint
