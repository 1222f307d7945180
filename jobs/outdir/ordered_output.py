"""`output.order: input`: the finished parts rewritten once, at the end, in (row_index, sample_index) order.

A k-way merge of the parts, each sorted by (row_index, sample_index) (unit parts are written so;
an unsorted part, which only older runs wrote, is sorted whole when it is read: a part holds at
most about `flush_rows` rows). Memory is bounded by `fan_in` sources at a time, each read a batch
at a time: with more parts than that, groups of them are first merged into sorted runs in a
scratch folder. Each round takes, from every source's current batch, the rows up to the smallest
last key among them, sorts those and appends them to the output, so the work is vectorised.
The output goes through the usual commit protocol as numbered parts of `flush_rows` rows.

Crash safety, with `_compact.json` in the output folder (written before the first new part):
phase `merge` names the source parts and the first new part number; a run that finds it rolls
back (deletes the new parts, keeps the sources). Once every new part is committed the record
says `remove`; a run that finds that deletes what is left of the sources. So a kill at any
point ends, after the rerun, with each (row, sample) exactly once.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.outdir.atomic_files import fsync_dir, write_atomically
from batchinfer.jobs.outdir.part_store import PART_PATTERN, commit_part, part_name, record_path
from batchinfer.jobs.outdir.resume import COMPACT_NAME

FAN_IN = 64          # sources merged at once
BATCH_ROWS = 1024    # rows read from a source at a time
RUN_GROUP_ROWS = 1024


def _read_record(out_dir: Path) -> Optional[dict]:
    try:
        record = json.loads((out_dir / COMPACT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_record(out_dir: Path, record: dict) -> None:
    write_atomically(out_dir / COMPACT_NAME, lambda temp: temp.write_text(json.dumps(record), encoding="utf-8"))
    fsync_dir(out_dir)


def _delete_part(out_dir: Path, name: str) -> None:
    (out_dir / name).unlink(missing_ok=True)
    record_path(out_dir, name).unlink(missing_ok=True)  # after the part: a record alone is a leftover


def finish_interrupted_compaction(out_dir: Path) -> Optional[str]:
    """Undo (phase merge) or complete (phase remove) a compaction a killed run left; → what was done.

    Call it holding the folder's lock, before its parts are read for resume."""
    record = _read_record(out_dir)
    if record is None:
        (out_dir / COMPACT_NAME).unlink(missing_ok=True)
        return None
    sources = set(record.get("sources", ()))
    if record.get("phase") == "remove":
        for name in sources:
            _delete_part(out_dir, name)
        done = "completed"
    else:
        first = int(record.get("first_number", 0))
        for path in list(out_dir.iterdir()):
            match = PART_PATTERN.match(path.name)
            if match and int(match.group(1)) >= first and path.name not in sources:
                _delete_part(out_dir, path.name)
        done = "rolled back"
    fsync_dir(out_dir)
    (out_dir / COMPACT_NAME).unlink()
    fsync_dir(out_dir)
    return done


class _Source:
    """One sorted source, a batch at a time, with its keys (row_index x n + sample_index)."""

    def __init__(self, path: Path, n: int, sort_whole: bool) -> None:
        self.n = n
        if sort_whole:
            table = pq.read_table(path).sort_by([("row_index", "ascending"), ("sample_index", "ascending")])
            self._batches: Iterator[pa.RecordBatch] = iter(table.to_batches(BATCH_ROWS))
        else:
            self._batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        self.batch: Optional[pa.Table] = None
        self.keys = np.zeros(0, dtype=np.int64)
        self._load()

    def _load(self) -> None:
        for batch in self._batches:
            if batch.num_rows:
                self.batch = pa.Table.from_batches([batch])
                self.keys = (self.batch["row_index"].to_numpy().astype(np.int64) * self.n
                             + self.batch["sample_index"].to_numpy().astype(np.int64))
                return
        self.batch = None

    def take_through(self, bound: int) -> tuple[pa.Table, np.ndarray]:
        """Its rows with key <= bound (from the current batch; the caller's bound never passes its end)."""
        assert self.batch is not None
        cut = int(np.searchsorted(self.keys, bound, side="right"))
        rows, keys = self.batch.slice(0, cut), self.keys[:cut]
        if cut == self.batch.num_rows:
            self._load()
        else:
            self.batch, self.keys = self.batch.slice(cut), self.keys[cut:]
        return rows, keys


def _merge(sources: Sequence[_Source], emit: Callable[[pa.Table], None]) -> None:
    last_key = -1
    active = [s for s in sources if s.batch is not None]
    while active:
        bound = min(int(s.keys[-1]) for s in active)
        pieces, keys = zip(*(s.take_through(bound) for s in active))
        table = pa.concat_tables(pieces, promote_options="default")
        merged_keys = np.concatenate(keys)
        order = np.argsort(merged_keys, kind="stable")
        ordered_keys = merged_keys[order]
        # A pair twice (never written so, but cheap to guarantee): the first copy is kept.
        keep = np.concatenate([[ordered_keys[0] != last_key], ordered_keys[1:] != ordered_keys[:-1]])
        emit(table.take(pa.array(order[keep])))
        last_key = int(ordered_keys[-1])
        active = [s for s in active if s.batch is not None]


def _merge_to_run(paths: Sequence[Path], n: int, unsorted: frozenset[str], target: Path) -> None:
    writer: Optional[pq.ParquetWriter] = None

    def emit(table: pa.Table) -> None:
        nonlocal writer
        if writer is None:
            writer = pq.ParquetWriter(target, table.schema)
        writer.write_table(table, row_group_size=RUN_GROUP_ROWS)

    try:
        _merge([_Source(p, n, p.name in unsorted) for p in paths], emit)
    finally:
        if writer is not None:
            writer.close()


class _PartEmitter:
    """Merged rows out as numbered parts of `flush_rows` rows."""

    def __init__(self, out_dir: Path, first_number: int, flush_rows: int, before_commit: Callable[[], None]) -> None:
        self.out_dir, self.number, self.flush_rows, self.before_commit = out_dir, first_number, flush_rows, before_commit
        self._pending: list[pa.Table] = []
        self._rows = 0
        self.names: list[str] = []

    def __call__(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._rows += table.num_rows
        while self._rows >= self.flush_rows:
            self._write(self.flush_rows)

    def _write(self, rows: int) -> None:
        table = pa.concat_tables(self._pending, promote_options="default")
        head, rest = table.slice(0, rows), table.slice(rows)
        self._pending, self._rows = ([rest] if rest.num_rows else []), rest.num_rows
        self.before_commit()
        name = part_name(self.number)
        commit_part(self.out_dir, name, head.combine_chunks())
        self.names.append(name)
        self.number += 1

    def close(self) -> None:
        if self._rows:
            self._write(self._rows)


def compact_in_input_order(out_dir: Path, parts: Sequence[Path], unsorted: frozenset[str], first_number: int,
                           flush_rows: int, n: int, scratch: Path,
                           before_commit: Callable[[], None] = lambda: None) -> list[str]:
    """Rewrite `parts` (verified, each pair once) as numbered parts from `first_number` in input
    order, then delete them; → the new part names. `scratch` holds the intermediate runs."""
    sources = sorted(parts, key=lambda p: p.name)
    _write_record(out_dir, {"phase": "merge", "sources": [p.name for p in sources], "first_number": first_number})
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    paths, names_unsorted, level = list(sources), unsorted, 0
    while len(paths) > FAN_IN:
        runs = []
        for index in range(0, len(paths), FAN_IN):
            run = scratch / f"run-{level}-{index // FAN_IN:05d}.parquet"
            _merge_to_run(paths[index:index + FAN_IN], n, names_unsorted, run)
            runs.append(run)
        for old in paths:
            if old.parent == scratch:
                old.unlink()
        paths, names_unsorted, level = runs, frozenset(), level + 1
    emitter = _PartEmitter(out_dir, first_number, flush_rows, before_commit)
    _merge([_Source(p, n, p.name in names_unsorted) for p in paths], emitter)
    emitter.close()
    fsync_dir(out_dir)
    _write_record(out_dir, {"phase": "remove", "sources": [p.name for p in sources], "first_number": first_number})
    for path in sources:
        _delete_part(out_dir, path.name)
    fsync_dir(out_dir)
    (out_dir / COMPACT_NAME).unlink()
    fsync_dir(out_dir)
    shutil.rmtree(scratch, ignore_errors=True)
    return emitter.names
