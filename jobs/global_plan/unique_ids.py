"""`id_column` values must be unique: checked during the planning pass, in bounded memory.

An id keys its row's samples (their seeds, and how users join results back), so two rows with
one id would be two rows nobody can tell apart. The tokenising pass hands each window's ids to
`IdHashes`, which appends 64-bit hashes of them to one of `PARTITIONS` files by their top bits;
`duplicate_id` then loads one partition at a time (8 bytes a row / PARTITIONS) and looks for
equal neighbours after a sort. Only when some hash repeats does a second pass over the id
column find the value (a hash collision between two distinct ids is no duplicate).
Null ids are not ids (they are left out); text ids are hashed as bytes, valid UTF-8 or not.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import polars as pl
import pyarrow as pa

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.inputs.files import iter_windows
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.spec.job_file import openai_batch_input

PARTITIONS = 256
FLUSH_HASHES = 1 << 20   # hashes buffered in memory before they go to their partition files
_SEED = 0x62617463       # any fixed seed: hashes are compared within one process only
WINDOW_ROWS = 8192       # rows read at a time by the second pass


def id_hashes(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """(positions of the non-null ids, their 64-bit hashes) of one window's id column."""
    array = pa.chunked_array([column]) if isinstance(column, pa.Array) else column
    array = array.combine_chunks()
    if pa.types.is_dictionary(array.type):  # hash values, not indices into each window's own dictionary
        array = array.dictionary_decode()
    if pa.types.is_string(array.type):
        array = array.cast(pa.binary())  # bytes as they are: text that is not UTF-8 is an id too
    elif pa.types.is_large_string(array.type):
        array = array.cast(pa.large_binary())
    valid = np.flatnonzero(~np.asarray(array.is_null().to_numpy(zero_copy_only=False), dtype=bool))
    ids = array.take(pa.array(valid))
    try:
        hashes = pl.Series(ids).hash(seed=_SEED).to_numpy().astype(np.uint64)
    except Exception:  # a type polars cannot hash (e.g. some nested ones): the values' text, in Python
        hashes = np.array([hash(repr(value)) & 0xFFFF_FFFF_FFFF_FFFF for value in ids.to_pylist()], dtype=np.uint64)
    return valid, hashes


class IdHashes:
    """Hashes of every id of the job, partitioned on disk by their top 8 bits."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def _path(self, partition: int) -> Path:
        return self.folder / f"ids-{partition:03d}.u64"

    def add(self, column: Any) -> None:
        _, hashes = id_hashes(column)
        self._buffer.append(hashes)
        self._buffered += len(hashes)
        if self._buffered >= FLUSH_HASHES:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        hashes = np.concatenate(self._buffer)
        self._buffer, self._buffered = [], 0
        partitions = (hashes >> np.uint64(56)).astype(np.int64)
        order = np.argsort(partitions, kind="stable")
        hashes, partitions = hashes[order], partitions[order]
        edges = np.flatnonzero(np.diff(partitions)) + 1
        for chunk in np.split(hashes, edges):
            if len(chunk):
                with open(self._path(int(chunk[0] >> np.uint64(56))), "ab") as handle:
                    handle.write(chunk.tobytes())

    def repeated(self) -> np.ndarray:
        """The hashes seen more than once (usually none)."""
        self.flush()
        found = []
        for partition in range(PARTITIONS):
            path = self._path(partition)
            if path.exists():
                hashes = np.sort(np.fromfile(path, dtype=np.uint64))
                found.append(np.unique(hashes[1:][hashes[1:] == hashes[:-1]]))
        return np.concatenate(found) if found else np.zeros(0, dtype=np.uint64)


def _values(column: Any) -> list:
    """The ids as Python values; text as bytes (decoded for the message only), valid UTF-8 or not."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        array = array.cast(pa.large_binary())
    return array.to_pylist()


def duplicate_id(windows: Iterable[tuple[int, Any]], repeated: np.ndarray) -> Optional[tuple[Any, int, int]]:
    """(value, first row, second row) of an id two rows share, from (first row, id column) windows
    read again; None when the repeated hashes were collisions of distinct ids."""
    if not len(repeated):
        return None
    seen: dict[Any, int] = {}
    for first_row, column in windows:
        positions, hashes = id_hashes(column)
        values = _values(column)
        for position in positions[np.isin(hashes, repeated)]:
            value = values[int(position)]
            key = value if not isinstance(value, (list, dict)) else repr(value)
            if key in seen:
                shown = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
                return shown, seen[key], first_row + int(position)
            seen[key] = first_row + int(position)
    return None


def check_unique_ids(job: PreparedJob, hashes: IdHashes) -> None:
    """A JobError naming the column and a value two rows share, after the tokenising pass fed `hashes`."""
    column = job.spec.id_column
    assert column is not None
    windows = ((window.first_row, window.table[column]) for window in iter_windows(job.inputs, WINDOW_ROWS,
                                                                                     job.spec.limit))
    found = duplicate_id(windows, hashes.repeated())
    if found is not None:
        value, first, second = found
        raise JobError(job.spec.job_file, job.spec.where("id_column"),
                       f"column {column!r} has the value {value!r} in rows {first} and {second}: ids must be "
                       "unique (each keys its row's samples, seeds and results)")


def checks_ids(job: PreparedJob) -> bool:
    """The job's own id column (an OpenAI batch file's seed keys are made by batchinfer, not ids)."""
    return job.spec.id_column is not None and not openai_batch_input(job.spec)
