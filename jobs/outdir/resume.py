"""Resume: what an output folder already holds, and whether it may be continued.

The manifest (`_job.json`) fingerprints everything that changes results: model, prompt
spec, chat settings, id column, sampling and the input files' contents. A rerun with the
same fingerprint skips every (row, sample) found in the verified parts and adds new parts;
a different fingerprint is refused (the old parts would silently mix with new results)
unless the user asks for --overwrite. One change of the input continues: files added that
sort after every earlier file (each earlier row keeps its index, so the run adds the new
rows); the rows covered (`limit` applied) may grow, never shrink (the parts would keep rows
past the new limit). Parts are verified against their records (`part_store`); a damaged part is moved
aside and its rows redone; a part-like file without a record is not ours and is left alone.
Temporary files and records of commits cut short are leftovers of a killed run, removed.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from batchinfer.jobs.outdir.atomic_files import is_temp_name, write_atomically
from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.outdir.part_store import (DAMAGED_SUFFIX, PART_PATTERN, PARTS_DIR, damaged_path, record_path, scan_parts)

MANIFEST_NAME = "_job.json"
COMPACT_NAME = "_compact.json"  # an interrupted rewrite in input order (jobs/outdir/ordered_output.py)
STATS_NAME = "_stats.json"   # underscore: `pq.read_table(out_dir)` skips it, as it skips the manifest
MANIFEST_VERSION = 2         # 2: part records in _parts/, input content hashes
INPUT_KEY = "input"
ROWS_KEY = "rows"            # input rows the job covers (limit applied): may grow on a rerun, never shrink


@dataclass(frozen=True)
class ResumeState:
    done: dict[int, frozenset[int]]  # row index -> sample indices already in verified parts
    next_part: int                    # number for the next part file
    finished_samples: int
    damaged: tuple[tuple[Path, str], ...] = ()  # parts that differ from their records (rows redone)
    foreign: tuple[Path, ...] = ()               # part-like files batchinfer did not write (ignored)
    parts: tuple[Path, ...] = ()                 # the verified parts, by name
    unsorted_parts: frozenset[str] = frozenset()  # names of parts whose rows are not in (row, sample) order
    in_input_order: bool = True                  # numbered parts only, in (row, sample) order across names


def _as_json(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint as it reads back from the manifest (tuples become lists, paths strings)."""
    return json.loads(json.dumps(fingerprint, sort_keys=True, default=str))


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """sha256 of a fingerprint as it reads back from JSON (the work folder's reuse key)."""
    return hashlib.sha256(json.dumps(_as_json(fingerprint), sort_keys=True).encode()).hexdigest()


def _read_manifest(out_dir: Path) -> Optional[dict[str, Any]]:
    """The manifest, {} when it exists but cannot be parsed, None when there is none."""
    path = out_dir / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def inputs_extend(old: Any, new: Any) -> bool:
    """Whether input `new` is input `old` with zero or more files added after its last one."""
    return isinstance(old, list) and isinstance(new, list) and new[:len(old)] == old


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Fingerprint sections that differ (the input only when it is not `old` plus later files)."""
    new = _as_json(new)
    changed = [key for key in set(old) | set(new) if key not in (INPUT_KEY, ROWS_KEY) and old.get(key) != new.get(key)]
    if not inputs_extend(old.get(INPUT_KEY), new.get(INPUT_KEY)):
        changed.append(INPUT_KEY)
    return sorted(changed)


def _has_records(out_dir: Path) -> bool:
    records = out_dir / PARTS_DIR
    return records.is_dir() and any(records.iterdir())


def check_resumable(out_dir: Path, fingerprint: dict[str, Any], overwrite: bool, job_file: Path, where: str) -> None:
    """Refuse (JobError) to continue an output folder made with different settings. Reads only the manifest."""
    if overwrite or not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise JobError(job_file, where, f"{display_path(out_dir)} exists and is not a folder")
    manifest = _read_manifest(out_dir)
    if manifest is None:
        if _has_records(out_dir):
            raise JobError(job_file, where, f"{display_path(out_dir)} holds parts without {MANIFEST_NAME}; "
                                            "use --overwrite to replace them")
        return
    if not manifest:
        raise JobError(job_file, where, f"{display_path(out_dir / MANIFEST_NAME)} cannot be read; "
                                        "use --overwrite to start again")
    if manifest.get("version") != MANIFEST_VERSION:
        raise JobError(job_file, where, f"{display_path(out_dir)} was written by another batchinfer version "
                                        f"(manifest version {manifest.get('version')}, this one writes "
                                        f"{MANIFEST_VERSION}); use --overwrite to start again")
    changed = changed_keys(manifest.get("fingerprint", {}), fingerprint)
    if changed:
        raise JobError(job_file, where, f"{display_path(out_dir)} was made with different settings "
                                        f"({', '.join(changed)} changed); use --overwrite to start again")
    old_rows, rows = manifest.get("fingerprint", {}).get(ROWS_KEY), fingerprint.get(ROWS_KEY)
    if isinstance(old_rows, int) and isinstance(rows, int) and rows < old_rows:  # its rows past the new limit stay
        raise JobError(job_file, where, f"{display_path(out_dir)} was made for {old_rows:,} rows and this run "
                                        f"covers {rows:,} (limit lowered); use --overwrite to start again")


def _legacy_parts(out_dir: Path) -> list[Path]:
    """Parts of a manifest-version-1 folder: written by batchinfer before parts had records."""
    manifest = _read_manifest(out_dir)
    if not manifest or manifest.get("version") != 1:
        return []
    return [p for p in out_dir.iterdir() if PART_PATTERN.match(p.name)]


def read_resume_state(out_dir: Path, overwrite: bool = False) -> ResumeState:
    """Which (row, sample) pairs the verified parts hold (with overwrite: none, all will go).

    Reads every part once to verify it; writes nothing.
    """
    scan = scan_parts(out_dir, verify=not overwrite)
    if overwrite:
        legacy = set(_legacy_parts(out_dir))
        foreign = tuple(p for p in scan.foreign if p not in legacy)
        numbers = [int(match.group(1)) for match in (PART_PATTERN.match(p.name) for p in foreign) if match]
        return ResumeState(done={}, next_part=max(numbers, default=-1) + 1, finished_samples=0, foreign=foreign)
    done: dict[int, set[int]] = defaultdict(set)
    finished = 0
    unsorted: set[str] = set()
    in_order = True
    previous: tuple[int, int] = (-1, -1)
    for path, keys in scan.finished:
        pairs = list(zip(keys["row_index"].to_pylist(), keys["sample_index"].to_pylist()))
        for row, sample in pairs:
            done[row].add(sample)
        finished += len(pairs)
        if any(a >= b for a, b in zip(pairs, pairs[1:])):
            unsorted.add(path.name)
        in_order = in_order and PART_PATTERN.match(path.name) is not None and path.name not in unsorted \
            and (not pairs or pairs[0] > previous)
        previous = pairs[-1] if pairs else previous
    return ResumeState(done={row: frozenset(s) for row, s in done.items()}, next_part=scan.next_number,
                       finished_samples=finished, damaged=scan.damaged, foreign=scan.foreign,
                       parts=tuple(path for path, _ in scan.finished), unsorted_parts=frozenset(unsorted),
                       in_input_order=in_order)


def _owned_files(out_dir: Path) -> list[Path]:
    """Files this tool wrote into an output folder (never a user's files, never the lock)."""
    if not out_dir.is_dir():
        return []
    scan = scan_parts(out_dir, verify=False)
    owned = [*scan.recorded, *_legacy_parts(out_dir)]
    owned += [p for p in out_dir.iterdir() if p.is_file() and (
        p.name in (MANIFEST_NAME, STATS_NAME, COMPACT_NAME) or is_temp_name(p.name)
        or (p.name.startswith(".part-") and p.name.endswith(DAMAGED_SUFFIX)))]
    return owned


def prepare_output_dir(out_dir: Path, fingerprint: dict[str, Any], overwrite: bool,
                       state: Optional[ResumeState] = None) -> None:
    """Clear leftovers (with overwrite: everything we wrote), move damaged parts aside, write the manifest.

    Call it holding the folder's lock, before any writer starts: it deletes temporaries.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    records = out_dir / PARTS_DIR
    if overwrite:
        for path in _owned_files(out_dir):
            path.unlink(missing_ok=True)
        shutil.rmtree(records, ignore_errors=True)
    else:
        for path in out_dir.iterdir():
            if is_temp_name(path.name) and path.is_file():
                path.unlink(missing_ok=True)
        for path, _ in (state.damaged if state else ()):
            path.replace(damaged_path(path))
            record_path(out_dir, path.name).unlink(missing_ok=True)
        for path in scan_parts(out_dir, verify=False).orphan_records:
            path.unlink(missing_ok=True)
    records.mkdir(exist_ok=True)
    for path in records.iterdir():
        if is_temp_name(path.name):
            path.unlink(missing_ok=True)
    manifest = {"version": MANIFEST_VERSION, "fingerprint": _as_json(fingerprint)}
    text = json.dumps(manifest, indent=2, sort_keys=True)
    write_atomically(out_dir / MANIFEST_NAME, lambda temp: temp.write_text(text, encoding="utf-8"))
