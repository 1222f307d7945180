"""Finished parts and their records: the commit protocol, and verification on resume.

A part is committed in four steps: written under a temporary dot-name unique to its writer,
fsynced, its record `_parts/<part name>.json` (size, row count, sha256 of the file) written
atomically, then the part renamed to its final name. So a part with its final name always
has a record, and a record without its part is a commit cut short (removed at the next
start). Several writers (worker processes, actors on other hosts) may commit parts into
one folder at once: nothing here deletes, and cleaning leftovers is the job of the run that
holds the folder's lock, before its writers start. `_parts/` and dot-names are skipped by
pyarrow's dataset discovery, so `pq.read_table(out_dir)` reads the parts alone.

Verification reads each part once (sha256 in 1 MiB pieces, then the two key columns from
the page cache): a part that differs from its record in any byte is damaged.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.outdir.atomic_files import fsync_dir, fsync_file, sha256_file, temp_path, write_atomically

# \Z, not $ (which matches before a final newline); [0-9], not \d (which matches any script's digits)
PART_PATTERN = re.compile(r"^part-([0-9]+)\.parquet\Z")
PART_NUMBER = re.compile(r"part-([0-9]+)\.parquet")  # in any name derived from a part's (records, asides)
# A work unit's part k: its name is fixed by the unit, so a unit run again rewrites the same names.
UNIT_PART_PATTERN = re.compile(r"^part-u([0-9]+)-([0-9]+)\.parquet\Z")
PARTS_DIR = "_parts"
RECORD_SUFFIX = ".json"
DAMAGED_SUFFIX = ".damaged"
KEY_COLUMNS = ("row_index", "sample_index")


def part_name(number: int) -> str:
    return f"part-{number:05d}.parquet"


def unit_part_name(unit_id: int, chunk: int) -> str:
    return f"part-u{unit_id:06d}-{chunk:03d}.parquet"


def is_part_name(name: str) -> bool:
    """A numbered part or a unit's part (both are batchinfer's when they have a record)."""
    return bool(PART_PATTERN.match(name) or UNIT_PART_PATTERN.match(name))


def record_path(out_dir: Path, name: str) -> Path:
    return out_dir / PARTS_DIR / f"{name}{RECORD_SUFFIX}"


def damaged_path(part: Path) -> Path:
    """Where a damaged part is moved: a dot-name, so readers skip it, kept for inspection."""
    return part.with_name(f".{part.name}{DAMAGED_SUFFIX}")


@dataclass(frozen=True)
class PartRecord:
    name: str
    bytes: int
    rows: int
    sha256: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def read(cls, path: Path) -> Optional["PartRecord"]:
        """The record in `path`, None if it cannot be parsed."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            record = cls(name=str(raw["name"]), bytes=int(raw["bytes"]), rows=int(raw["rows"]),
                         sha256=str(raw["sha256"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return record


def _write_table(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path)


def commit_part(out_dir: Path, name: str, table: pa.Table) -> PartRecord:
    """Write `table` as the finished part `name`, record first; → its record.

    Leaves no temporary behind when it fails; the part's final name appears only once the
    part and its record are both durable.
    """
    final = out_dir / name
    temp = temp_path(final)
    try:
        _write_table(table, temp)
        fsync_file(temp)
        record = PartRecord(name=name, bytes=temp.stat().st_size, rows=table.num_rows, sha256=sha256_file(temp))
        (out_dir / PARTS_DIR).mkdir(exist_ok=True)
        write_atomically(record_path(out_dir, name), lambda path: path.write_text(record.to_json(), encoding="utf-8"))
        os.replace(temp, final)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        if exc.filename is None:  # pyarrow's write errors name no file: say which part (a full disk's line)
            raise OSError(exc.errno, exc.strerror or str(exc), str(final)) from exc
        raise
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(out_dir)
    return record


def verify_part(path: Path, record: Optional[PartRecord]) -> tuple[Optional[pa.Table], str]:
    """(key columns, "") of a part that matches its record, else (None, what is wrong)."""
    if record is None:
        return None, "its record in _parts/ cannot be read"
    size = path.stat().st_size
    if size != record.bytes:
        return None, f"{size} bytes, its record says {record.bytes}"
    if sha256_file(path) != record.sha256:
        return None, "its sha256 differs from its record"
    try:
        keys = pq.read_table(path, columns=list(KEY_COLUMNS))
    except (pa.ArrowException, OSError, KeyError) as exc:
        return None, f"unreadable ({exc})"
    if keys.num_rows != record.rows:
        return None, f"{keys.num_rows} rows, its record says {record.rows}"
    return keys, ""


@dataclass(frozen=True)
class PartScan:
    """What an output folder holds, part by part."""

    finished: tuple[tuple[Path, pa.Table], ...]  # verified parts and their key columns
    damaged: tuple[tuple[Path, str], ...]        # parts that differ from their records, and how
    foreign: tuple[Path, ...]                    # part-like files without a record: not ours
    orphan_records: tuple[Path, ...]             # records of commits cut short (no part)
    next_number: int                             # above every part number in use or seen

    @property
    def recorded(self) -> tuple[Path, ...]:
        """Every part batchinfer wrote (finished or damaged)."""
        return tuple(path for path, _ in self.finished) + tuple(path for path, _ in self.damaged)


def scan_parts(out_dir: Path, verify: bool = True) -> PartScan:
    """Sort the folder's parts into finished, damaged and foreign (verify=False: trust records)."""
    finished, damaged, foreign, numbers = [], [], [], [-1]
    names = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    records_dir = out_dir / PARTS_DIR
    record_names = sorted(p.name for p in records_dir.iterdir()) if records_dir.is_dir() else []
    for name in names + record_names:
        match = PART_NUMBER.search(name)
        if match:
            numbers.append(int(match.group(1)))
    for name in names:
        if not is_part_name(name):
            continue
        path = out_dir / name
        record_file = record_path(out_dir, name)
        if not record_file.is_file():
            foreign.append(path)
            continue
        record = PartRecord.read(record_file)
        if not verify:
            if record is None:
                damaged.append((path, "its record in _parts/ cannot be read"))
            else:
                finished.append((path, pa.table({})))
            continue
        keys, reason = verify_part(path, record)
        if keys is None:
            damaged.append((path, reason))
        else:
            finished.append((path, keys))
    orphans = [records_dir / name for name in record_names
               if name.endswith(RECORD_SUFFIX) and not (out_dir / name[:-len(RECORD_SUFFIX)]).exists()]
    return PartScan(tuple(finished), tuple(damaged), tuple(foreign), tuple(orphans), max(numbers) + 1)


def samples_on_disk(out_dir: Path) -> tuple[int, int]:
    """((row, sample) pairs, parts) in the folder's recorded parts, from their records (no part is read)."""
    total = parts = 0
    for path in scan_parts(out_dir, verify=False).recorded:
        record = PartRecord.read(record_path(out_dir, path.name))
        total += record.rows if record is not None else 0
        parts += 1
    return total, parts
