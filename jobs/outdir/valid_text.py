"""Valid UTF-8 in every string value an output part holds.

Parquet writers copy string bytes as they are and Parquet files carry no UTF-8 check, but
polars (and DuckDB) refuse a whole file that holds one invalid string, and pyarrow's
`to_pylist` raises on it. Input columns are carried into the outputs as they were read,
so a careless export (Latin-1 bytes in a `string` column) would make every part of the job
unreadable. `repair_table` makes such a table valid before it is written:

- a text value (string / large_string / string_view, also as a dictionary's values, a
  list's items or a struct's field) has its invalid bytes replaced by U+FFFD, as Python's
  `bytes.decode(errors="replace")` does;
- a value of another nested type (map, fixed-size list, union) that holds invalid text is
  written as null;
- it says which rows it changed, by the first column it changed in each, so the caller can
  report the row's error.

A valid table (the usual case) costs one vectorised validation pass per column.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa

_AS_BYTES = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(), pa.string_view(): pa.binary_view()}
_LISTS = (pa.ListArray, pa.LargeListArray)


def invalid_utf8_message(column: str) -> str:
    return f"column {column!r} is not valid UTF-8 (invalid bytes written as U+FFFD)"


def _is_valid(array: pa.Array) -> bool:
    try:
        array.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _repair_text(array: pa.Array) -> tuple[pa.Array, np.ndarray]:
    raw = array.view(_AS_BYTES[array.type]).to_pylist()
    bad = np.zeros(len(raw), dtype=bool)
    texts: list[Optional[str]] = []
    for offset, value in enumerate(raw):
        if value is None:
            texts.append(None)
            continue
        try:
            texts.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            bad[offset] = True
            texts.append(value.decode("utf-8", errors="replace"))
    return pa.array(texts, type=array.type), bad


def _per_row(counts_bad: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Whether any child value in each row's [offsets[i], offsets[i + 1]) range is bad."""
    running = np.concatenate([[0], np.cumsum(counts_bad, dtype=np.int64)])
    return running[offsets[1:]] > running[offsets[:-1]]


def _null_bad_rows(array: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Any other nested type: a value holding invalid text (found row by row) becomes null."""
    bad = np.array([not _is_valid(array.take([row])) for row in range(len(array))], dtype=bool)  # take: its own bytes only
    indices = pa.array(np.arange(len(array)), mask=bad)  # a null index takes a null value
    return array.take(indices), bad


def repair_array(array: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(`array` with valid UTF-8 everywhere, which of its rows changed)."""
    if _is_valid(array):
        return array, np.zeros(len(array), dtype=bool)
    kind = array.type
    if kind in _AS_BYTES:
        return _repair_text(array)
    if isinstance(array, pa.DictionaryArray):
        dictionary, bad_values = repair_array(array.dictionary)
        indices = array.indices.to_numpy(zero_copy_only=False)
        valid = array.indices.is_valid().to_numpy(zero_copy_only=False)
        bad = np.zeros(len(array), dtype=bool)
        bad[valid] = bad_values[indices[valid].astype(np.int64)]
        return pa.DictionaryArray.from_arrays(array.indices, dictionary), bad
    if isinstance(array, pa.StructArray):
        repaired = [repair_array(array.field(i)) for i in range(kind.num_fields)]  # field() follows the slice
        bad = np.logical_or.reduce([b for _, b in repaired]) if repaired else np.zeros(len(array), dtype=bool)
        mask = array.is_null() if array.null_count else None
        return pa.StructArray.from_arrays([a for a, _ in repaired], fields=list(kind), mask=mask), bad
    if type(array) in _LISTS:  # not MapArray, a ListArray subclass
        offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        offsets -= offsets[0]  # a sliced list: its own items only, offsets from 0 (from_arrays needs that)
        values, bad_values = repair_array(array.values.slice(int(array.offsets[0].as_py()), int(offsets[-1])))
        mask = array.is_null() if array.null_count else None
        offset_type = pa.int64() if isinstance(array, pa.LargeListArray) else pa.int32()
        rebuilt = type(array).from_arrays(pa.array(offsets, offset_type), values, type=kind, mask=mask)
        return rebuilt, _per_row(bad_values, offsets)
    return _null_bad_rows(array)


def repair_table(table: pa.Table) -> tuple[pa.Table, dict[int, str]]:
    """(`table` with valid UTF-8 in every value, {row: the first column whose value was repaired})."""
    changed: dict[int, str] = {}
    for index, name in enumerate(table.column_names):
        column = table.column(index)
        try:
            column.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        chunks, start = [], 0
        for chunk in column.chunks:
            fixed, bad = repair_array(chunk)
            for row in np.flatnonzero(bad):
                changed.setdefault(start + int(row), name)
            chunks.append(fixed)
            start += len(chunk)
        table = table.set_column(index, table.schema.field(index), pa.chunked_array(chunks, type=column.type))
    return table, changed


def valid_cells(column: pa.ChunkedArray, name: str) -> tuple[list, dict[int, str]]:
    """A column's values as Python objects, and {row: error} for each value holding invalid UTF-8
    (at any depth), which reads as None: a cell the job must interpret (continuations, a schema)
    makes its row's error, not a decode error of the whole table."""
    values: list = []
    errors: dict[int, str] = {}
    for chunk in column.chunks:
        fixed, bad = repair_array(chunk)
        cells = fixed.to_pylist()
        for row in np.flatnonzero(bad):
            cells[int(row)] = None
            errors[len(values) + int(row)] = f"column {name!r} is not valid UTF-8"
        values.extend(cells)
    return values, errors
