"""`batchinfer show OUT`: what an output folder holds, for a finished job or one still running or
stopped: its last `_stats.json`, the (row, sample) pairs its recorded parts hold, and who holds it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.outdir.lock import LockHolder, live_holder
from batchinfer.jobs.outdir.part_store import samples_on_disk
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


def render_report(console: Console, out_dir: Path, report: FolderReport) -> None:
    if report.stats is not None:
        render_summary(console, report.stats)
    else:
        console.print(f"{display_path(out_dir)}: no run has finished or stopped here yet (no {STATS_NAME})")
    covers = f" of {report.rows:,} input rows" if report.rows is not None else ""
    console.print(f"on disk: {report.samples_on_disk:,} samples in {report.parts:,} parts{covers}")
    if report.holder is not None:
        console.print(f"running: held by {report.holder.describe()}; these figures grow until it ends")
