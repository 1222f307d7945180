"""`batchinfer show OUT`: what an output folder holds, for a finished job or one still running or
stopped: its last `_stats.json`, the (row, sample) pairs its recorded parts hold, and who holds it.
An s3:// folder is read-only: its manifest, stats and part records are fetched into a temporary
folder (empty stand-ins for the parts they name; no part is read) and its lock object is read."""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.fs as pafs

from rich.console import Console

from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.outdir.lock import STALE_AFTER_SECONDS, LockHolder, live_holder
from batchinfer.jobs.outdir.lock_holder import _parse_holder, this_process
from batchinfer.jobs.outdir.object_store import StoreError, open_store
from batchinfer.jobs.outdir.part_store import PARTS_DIR, RECORD_SUFFIX, is_part_name, samples_on_disk
from batchinfer.jobs.outdir.remote_lock import LOCK_NAME, _stale
from batchinfer.jobs.outdir.resume import MANIFEST_NAME, ROWS_KEY, STATS_NAME
from batchinfer.jobs.outdir.stats import render_summary


@dataclass(frozen=True)
class FolderReport:
    stats: Optional[dict[str, Any]]  # the last run's _stats.json (None: no run wrote one yet)
    rows: Optional[int]              # input rows the job covers, from the manifest
    samples_on_disk: int             # (row, sample) pairs in recorded parts
    parts: int
    holder: Optional[LockHolder]     # a live run holding the folder now


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def folder_report(out_dir: Path) -> FolderReport:
    """Raises JobError when `out_dir` is not a batchinfer output folder."""
    out_dir = Path(out_dir)
    manifest, stats = _read_json(out_dir / MANIFEST_NAME), _read_json(out_dir / STATS_NAME)
    if manifest is None and stats is None:
        raise JobError(out_dir, "(folder)", f"not a batchinfer output folder (no {MANIFEST_NAME} or {STATS_NAME})")
    samples, parts = samples_on_disk(out_dir)
    fingerprint = (manifest or {}).get("fingerprint")
    rows = fingerprint.get(ROWS_KEY) if isinstance(fingerprint, dict) else None
    return FolderReport(stats, rows if isinstance(rows, int) else None, samples, parts, live_holder(out_dir))


def remote_folder_report(url: str) -> FolderReport:
    """The report of s3:// folder `url`, nothing written there (StoreError: unreadable, or not an output)."""
    store = open_store(url)
    selector = pafs.FileSelector(store.path, recursive=True, allow_not_found=True)
    try:
        entries = {entry.path[len(store.path) + 1:]: entry for entry in store.filesystem.get_file_info(selector)
                   if entry.type == pafs.FileType.File}
        if MANIFEST_NAME not in entries and STATS_NAME not in entries:
            raise StoreError(f"{store.url}: not a batchinfer output folder (no {MANIFEST_NAME} or {STATS_NAME})")
        records = [name for name in entries if name.startswith(f"{PARTS_DIR}/") and name.endswith(RECORD_SUFFIX)]
        with tempfile.TemporaryDirectory(prefix="batchinfer-show-") as scratch:
            folder = Path(scratch)
            (folder / PARTS_DIR).mkdir()
            for name in [MANIFEST_NAME, STATS_NAME, *records]:
                if name in entries:
                    with store.filesystem.open_input_stream(store.child(name)) as stream:
                        (folder / name).write_bytes(stream.read())
            for name in entries:  # stand-ins: samples are counted from the records alone
                if "/" not in name and is_part_name(name) and f"{PARTS_DIR}/{name}{RECORD_SUFFIX}" in entries:
                    (folder / name).touch()
            report = folder_report(folder)
        holder = _remote_holder(store, entries.get(LOCK_NAME))
    except (pa.ArrowException, OSError) as exc:
        raise StoreError(f"{store.url}: cannot be read ({exc})") from None
    return replace(report, holder=holder)


def _remote_holder(store, lock: Optional[pafs.FileInfo]) -> Optional[LockHolder]:
    """The run the lock object names while it is fresh (age by its Last-Modified; this host: its pid)."""
    if lock is None:
        return None
    with store.filesystem.open_input_stream(store.child(LOCK_NAME)) as stream:
        holder = _parse_holder(stream.read().decode("utf-8", errors="replace"))
    age = time.time() - lock.mtime.timestamp() if lock.mtime is not None else None
    stale, _age = _stale(holder, age, this_process(), STALE_AFTER_SECONDS)
    return None if stale else holder


def render_report(console: Console, out_dir: Union[Path, str], report: FolderReport) -> None:
    where = out_dir if isinstance(out_dir, str) else display_path(out_dir)
    if report.stats is not None:
        render_summary(console, report.stats)
    else:
        console.print(f"{where}: no run has finished or stopped here yet (no {STATS_NAME})")
    covers = f" of {report.rows:,} input rows" if report.rows is not None else ""
    console.print(f"on disk: {report.samples_on_disk:,} samples in {report.parts:,} parts{covers}")
    if report.holder is not None:
        console.print(f"running: held by {report.holder.describe()}; these figures grow until it ends")
