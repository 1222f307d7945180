"""Resume: what an output folder already holds, and whether it may be continued.

The manifest (`_job.json`) fingerprints everything that changes results: model, prompt
spec, chat settings, sampling and input files. A rerun with the same fingerprint skips
every (row, sample) found in the finished parts and adds new parts; a different
fingerprint is refused (the old parts would silently mix with new results) unless the
user asks for --overwrite. Temporary files are leftovers of a killed run and are removed.
"""
from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.errors import JobError, display_path
from jobs.outputs import PART_PATTERN, ROW_INDEX_COLUMN, TEMP_SUFFIX, write_atomically

MANIFEST_NAME = "_job.json"
STATS_NAME = "_stats.json"   # underscore: `pq.read_table(out_dir)` skips it, as it skips the manifest
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class ResumeState:
    done: dict[int, frozenset[int]]  # row index -> sample indices already in finished parts
    next_part: int                    # number for the next part file
    finished_samples: int


def _as_json(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint as it reads back from the manifest (tuples become lists, paths strings)."""
    return json.loads(json.dumps(fingerprint, sort_keys=True, default=str))


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(_as_json(fingerprint), sort_keys=True).encode()).hexdigest()


def _owned_files(out_dir: Path) -> list[Path]:
    """Files this tool writes into an output folder (never anything else a user put there)."""
    if not out_dir.is_dir():
        return []
    return [p for p in out_dir.iterdir() if p.is_file() and (
        PART_PATTERN.match(p.name) or p.name in (MANIFEST_NAME, STATS_NAME)
        or (p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX)))]


def check_resumable(out_dir: Path, fingerprint: dict[str, Any], overwrite: bool, job_file: Path, where: str) -> None:
    """Refuse (JobError) to continue an output folder made with different settings."""
    manifest_path = out_dir / MANIFEST_NAME
    if overwrite or not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise JobError(job_file, where, f"{display_path(out_dir)} exists and is not a folder")
    parts = sorted(p for p in out_dir.iterdir() if PART_PATTERN.match(p.name))
    for part in parts:
        try:  # the footer only: cheap, and a part that lost its footer (power loss) fails here
            pq.read_metadata(part)
        except (pa.ArrowException, OSError) as exc:
            raise JobError(job_file, where, f"{display_path(part)} is unreadable ({exc}); delete it to redo "
                                            "its rows, or use --overwrite") from None
    has_parts = bool(parts)
    if not manifest_path.is_file():
        if has_parts:
            raise JobError(job_file, where, f"{display_path(out_dir)} holds parts without {MANIFEST_NAME}; "
                                            "use --overwrite to replace them")
        return
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = {}
    if manifest.get("fingerprint_sha256") != fingerprint_digest(fingerprint):
        old, new = manifest.get("fingerprint", {}), _as_json(fingerprint)
        changed = sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))
        reason = f" ({', '.join(changed)} changed)" if changed else ""
        raise JobError(job_file, where, f"{display_path(out_dir)} was made with different settings{reason}; "
                                        "use --overwrite to start again")


def prepare_output_dir(out_dir: Path, fingerprint: dict[str, Any], overwrite: bool) -> None:
    """Create the folder, drop leftovers (or everything we own, with overwrite), write the manifest."""
    for path in _owned_files(out_dir):
        if overwrite or path.name.endswith(TEMP_SUFFIX):
            path.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"version": MANIFEST_VERSION, "fingerprint_sha256": fingerprint_digest(fingerprint),
                "fingerprint": _as_json(fingerprint)}
    text = json.dumps(manifest, indent=2, sort_keys=True)
    write_atomically(out_dir / MANIFEST_NAME, lambda temp: temp.write_text(text, encoding="utf-8"))


def read_resume_state(out_dir: Path) -> ResumeState:
    """Which (row, sample) pairs the finished parts hold, reading only the two key columns."""
    done: dict[int, set[int]] = defaultdict(set)
    last_part = -1
    finished = 0
    for path in sorted(out_dir.iterdir()) if out_dir.is_dir() else []:
        match = PART_PATTERN.match(path.name)
        if not match:
            continue
        last_part = max(last_part, int(match.group(1)))
        keys = pq.read_table(path, columns=[ROW_INDEX_COLUMN, "sample_index"])
        for row, sample in zip(keys[ROW_INDEX_COLUMN].to_pylist(), keys["sample_index"].to_pylist()):
            done[row].add(sample)
            finished += 1
    return ResumeState(done={row: frozenset(s) for row, s in done.items()}, next_part=last_part + 1,
                       finished_samples=finished)
