"""Files that appear complete or not at all, and their checksums (parts, and `_work/` files, verified on reuse).

A file is written under a temporary dot-name unique to its writer (process and a random
suffix, so two writers of one name never share a temporary), fsynced, then renamed.
Dot-names are what pyarrow's dataset discovery skips, so readers never see a half file.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Callable, Optional

TEMP_SUFFIX = ".tmp"
HASH_CHUNK_BYTES = 1 << 20


def temp_path(path: Path) -> Path:
    """A temporary name beside `path` that no other writer uses."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(temp_path)`, make it durable, then rename it to `path`; no temporary is left behind."""
    temp = temp_path(path)
    try:
        write(temp)
        fsync_file(temp)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces (bounded memory for any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_checksum(path: Path) -> dict:
    """A committed file's checksum record: {"bytes", "sha256"} (what `checksum_problem` verifies)."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def checksum_problem(path: Path, record: object) -> Optional[str]:
    """Why `path` differs from its checksum record (missing, size, content), None when it matches."""
    if not isinstance(record, dict) or not {"bytes", "sha256"} <= set(record):
        return "no checksum recorded"
    try:
        size = path.stat().st_size
    except OSError:
        return "missing"
    if size != record["bytes"]:
        return f"{size} bytes, {record['bytes']} recorded"
    if sha256_file(path) != record["sha256"]:
        return "sha256 differs from its record"
    return None
