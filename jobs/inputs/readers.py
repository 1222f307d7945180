"""Inputs that are not Parquet (CSV, JSON Lines rows, Arrow IPC / Feather, a Hugging Face
`save_to_disk` folder): each source is read once with pyarrow and converted to one Parquet
file, which the Parquet path (`files.py`: stamps, windows, resume) then reads.

Converted files live in `$BATCHINFER_CACHE_DIR/inputs/` (default `~/.cache/batchinfer`), named
by the source's sha256 and format, so a rerun reuses them and an edited source is a new file.
The job's fingerprint records the SOURCE files (name, bytes, sha256), never the converted
ones: resume and the `input changed` check refer to the user's files. A source that cannot be
parsed is one `JobError` naming the file and pyarrow's line/row, and nothing is written.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.ipc as ipc
import pyarrow.json as pjson
import pyarrow.parquet as pq

from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.outdir.atomic_files import HASH_CHUNK_BYTES

# formats by name when the job's `input_format` is auto (jobs/spec/job_file.py INPUT_FORMATS)
SUFFIX_FORMATS = {".parquet": "parquet", ".csv": "csv", ".csv.gz": "csv", ".ndjson": "jsonl",
                  ".jsonl": "openai_batch", ".arrow": "arrow", ".feather": "arrow"}
HF_MARKERS = ("dataset_info.json", "state.json")
CONVERTED_VERSION = "v1"  # part of each converted file's name: a reader change makes new files


def is_hf_dataset(path: Path) -> bool:
    """A folder written by `datasets.Dataset.save_to_disk`: its markers and `data-*.arrow` files."""
    return path.is_dir() and any((path / name).is_file() for name in HF_MARKERS) and bool(_hf_files(path))


def _hf_files(folder: Path) -> list[Path]:
    """The folder's arrow shards in row order (state.json lists them; else their sorted names)."""
    state = folder / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        return [folder / name for name in names]
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p for p in folder.glob("data-*.arrow") if p.is_file())


def format_of(path: Path, declared: str) -> str:
    """The format of input `path`: the job's `input_format`, or by its name when that is auto."""
    if declared != "auto":
        return declared
    if is_hf_dataset(path):
        return "hf_dataset"
    name = path.name.lower()
    for suffix in sorted(SUFFIX_FORMATS, key=len, reverse=True):
        if name.endswith(suffix):
            return SUFFIX_FORMATS[suffix]
    return "parquet"


def _cache_dir() -> Path:
    root = os.environ.get("BATCHINFER_CACHE_DIR") or os.path.join("~", ".cache", "batchinfer")
    return Path(root).expanduser() / "inputs"


def _source_entry(path: Path) -> tuple[dict, os.stat_result]:
    """(name, bytes, sha256) of `path`, and its stat when hashing started (to see a swap during the read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        stat = os.fstat(handle.fileno())
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return {"file": path.name, "bytes": stat.st_size, "sha256": digest.hexdigest()}, stat


def _same_file(path: Path, stat: os.stat_result) -> bool:
    now = os.stat(path)
    return (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) == (stat.st_dev, stat.st_ino, stat.st_size,
                                                                      stat.st_mtime_ns)


def _parse_error(path: Path, fmt: str, exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = (_csv_bad_line(path) if fmt == "csv" else None) or (lines[0] if lines else type(exc).__name__)
    return f"{display_path(path)}: not a readable {FORMAT_WORDS[fmt]} file ({reason})"


def _csv_bad_line(path: Path) -> Optional[str]:
    """The first row with the wrong number of fields, by line (pyarrow's own error names no line)."""
    bad = []

    def first_bad(row) -> str:
        bad.append(row)
        return "skip"

    try:  # single-threaded: only then does pyarrow number the rows
        pcsv.read_csv(path, read_options=pcsv.ReadOptions(use_threads=False, block_size=1 << 26),
                      parse_options=pcsv.ParseOptions(newlines_in_values=True, invalid_row_handler=first_bad))
    except (pa.ArrowException, OSError, EOFError, ValueError):
        pass
    if not bad:
        return None
    row = bad[0]
    where = f"line {row.number}" if row.number is not None else "a row"
    return f"{where}: expected {row.expected_columns} fields, got {row.actual_columns}: {row.text[:80]!r}"


def _read(path: Path, fmt: str) -> pa.Table:
    """The whole of one source file as a table (pyarrow's errors propagate)."""
    if fmt == "csv":
        # pyarrow infers types from the first block only; let it see the whole file for small inputs
        return pcsv.read_csv(path, read_options=pcsv.ReadOptions(block_size=1 << 26),
                             parse_options=pcsv.ParseOptions(newlines_in_values=True))  # quoted multi-line text
    if fmt == "jsonl":
        opener = gzip.open if path.name.lower().endswith(".gz") else open
        with opener(path, "rb") as handle:
            return pjson.read_json(handle, read_options=pjson.ReadOptions(block_size=1 << 26))
    if fmt == "arrow":
        try:
            with ipc.open_file(path) as reader:  # Arrow IPC file, which is Feather v2
                return reader.read_all()
        except pa.ArrowInvalid:
            import pyarrow.feather as feather  # Feather v1, or an IPC stream
            try:
                return feather.read_table(path)
            except pa.ArrowInvalid:
                with ipc.open_stream(path) as reader:
                    return reader.read_all()
    if fmt == "hf_stream":
        with ipc.open_stream(path) as reader:  # save_to_disk writes IPC streams
            return reader.read_all()
    raise AssertionError(fmt)


FORMAT_WORDS = {"csv": "CSV", "jsonl": "JSON Lines", "arrow": "Arrow IPC / Feather", "hf_stream": "Arrow stream"}


def convert_input(path: Path, fmt: str, job_file: Path, where: str) -> tuple[Path, list[dict]]:
    """Source `path` of format `fmt` as a Parquet file in the cache → (that file, the source's fingerprint)."""
    files = _hf_files(path) if fmt == "hf_dataset" else [path]
    part_format = "hf_stream" if fmt == "hf_dataset" else fmt
    if not files:
        raise JobError(job_file, where, f"{display_path(path)}: Hugging Face dataset folder has no data-*.arrow files")
    entries, stats = [], []
    for file in files:
        try:
            entry, stat = _source_entry(file)
        except OSError as exc:
            raise JobError(job_file, where, f"{display_path(file)}: cannot be read ({exc.strerror or exc})") from None
        entries.append(entry)
        stats.append(stat)
    key = hashlib.sha256(json.dumps([fmt, CONVERTED_VERSION, entries]).encode()).hexdigest()
    target = _cache_dir() / f"{key}.parquet"
    if target.is_file():
        return target, entries
    tables = []
    for file in files:
        try:
            tables.append(_read(file, part_format))
        except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
            raise JobError(job_file, where, _parse_error(file, part_format, exc)) from None
    for file, stat in zip(files, stats):
        if not _same_file(file, stat):
            raise JobError(job_file, where, f"{display_path(file)} changed while it was read; rerun once the "
                                            "input is final")
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid:
        raise JobError(job_file, where, f"{display_path(path)}: its data-*.arrow files differ in schema") from None
    _write_atomically(table.replace_schema_metadata(None), target)
    return target, entries


def _write_atomically(table: pa.Table, target: Path) -> None:
    """The converted file appears whole or not at all (two jobs converting one source both succeed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".converting-", suffix=".parquet", dir=target.parent)
    os.close(handle)
    try:
        pq.write_table(table, temporary)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise

