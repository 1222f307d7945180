"""Inputs at object-store URLs (`s3://`, `gs://`, `https://`): each object is fetched once into
`$BATCHINFER_CACHE_DIR/inputs/remote/` and the job reads the local copy through the usual path
(Parquet, or a conversion by `readers.py`), so windows, stamps and fingerprints work unchanged.

A copy is named by the object's URL, size and modification time (pyarrow's FileInfo carries no
ETag; https uses ETag / Last-Modified when the server sends them): a rerun reuses it, a rewritten
object is fetched again, and the job's fingerprint hashes the copy, so a changed object refuses
to resume like a changed local file. The object's size and mtime are checked again after the
download: an object replaced while it was fetched is a one-line error, never a mixed copy. The
job then reads its own snapshot, so a later write to the object cannot reach a running job.

s3:// and gs:// go through pyarrow's filesystems (`jobs/outdir/object_store.py`); a pattern
with `*`, `?`, `[...]` or `**` lists the prefix before the first such part; a prefix without
one (a "folder") means its `*.parquet` objects, as a local folder does. https is read-only,
one file per URL, through the standard library.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.inputs.input_glob import has_glob
from batchinfer.jobs.outdir.object_store import Store, StoreError, info, open_store
from batchinfer.jobs.spec.urls import cache_root, url_scheme

COPY_CHUNK_BYTES = 8 << 20
HTTP_TIMEOUT_SECONDS = 60


def fetch_inputs(pattern: str, job_file: Path, where: str) -> dict[Path, str]:
    """Local copies of the objects `pattern` names → their URLs, in the sorted order of their keys."""
    try:
        if url_scheme(pattern) in ("http", "https"):
            return {_fetch_http(pattern): pattern}
        return _fetch_objects(pattern)
    except StoreError as exc:
        raise JobError(job_file, where, str(exc)) from None


def _glob_regex(pattern: str) -> re.Pattern:
    """fnmatch within one name, `**/` as zero or more folders (as jobs/inputs/input_glob.py)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _list(store: Store, recursive: bool) -> list[pafs.FileInfo]:
    try:
        listed = store.filesystem.get_file_info(pafs.FileSelector(store.path, recursive=recursive,
                                                                  allow_not_found=True))
    except (pa.ArrowException, OSError) as exc:
        raise StoreError(f"{store.url}: cannot be listed ({exc})") from None
    return [entry for entry in listed if entry.type == pafs.FileType.File]


def _fetch_objects(pattern: str) -> dict[Path, str]:
    scheme_end = pattern.index("://") + 3
    parts = pattern[scheme_end:].split("/")
    first_glob = next((i for i, part in enumerate(parts) if has_glob(part)), None)
    if first_glob is not None:
        if first_glob == 0:
            raise StoreError(f"{pattern}: the bucket name cannot be a pattern")
        store = open_store(pattern[:scheme_end] + "/".join(parts[:first_glob]))
        matcher = _glob_regex("/".join(parts[first_glob:]))
        objects = [entry for entry in _list(store, recursive=True)
                   if matcher.match(entry.path[len(store.path) + 1:])]
        if not objects:
            raise StoreError(f"no objects match: {pattern}")
    else:
        store = open_store(pattern)
        found = info(store, "")
        if found.type == pafs.FileType.File:
            objects = [found]
        else:
            objects = [entry for entry in _list(store, recursive=False) if entry.base_name.endswith(".parquet")]
            if not objects:
                what = "no .parquet objects under" if found.type == pafs.FileType.Directory else "no such object"
                raise StoreError(f"{what}: {pattern}")
    scheme = pattern[:scheme_end]
    return {_fetch_object(store, entry): scheme + entry.path
            for entry in sorted(objects, key=lambda entry: entry.path)}


def _copy_path(url: str, validators: list, name: str) -> Path:
    key = hashlib.sha256(repr([url, *validators]).encode()).hexdigest()[:24]
    return cache_root() / "inputs" / "remote" / key / name


def _fetch_object(store: Store, entry: pafs.FileInfo) -> Path:
    url = f"{store.url.split('://')[0]}://{entry.path}"
    target = _copy_path(url, [entry.size, entry.mtime_ns], entry.base_name)
    if target.is_file() and target.stat().st_size == entry.size:
        return target
    try:
        with store.filesystem.open_input_stream(entry.path) as source:
            _write_copy(target, lambda handle: _copy(source, handle))
        after = store.filesystem.get_file_info(entry.path)
    except (pa.ArrowException, OSError) as exc:
        raise StoreError(f"{url}: cannot be read ({exc})") from None
    if (after.size, after.mtime_ns) != (entry.size, entry.mtime_ns) or target.stat().st_size != entry.size:
        target.unlink(missing_ok=True)
        raise StoreError(f"{url} changed while it was fetched; rerun once the input is final")
    return target


def _fetch_http(url: str) -> Path:
    if has_glob(url.split("?", 1)[0].split("://", 1)[1]):
        raise StoreError(f"{url}: an http(s) input is one file (no patterns)")
    name = os.path.basename(url.split("?", 1)[0].rstrip("/")) or "input"
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_SECONDS) as response:
            validators = [response.headers.get("ETag"), response.headers.get("Last-Modified"),
                          response.headers.get("Content-Length")]
            stable = validators[0] or validators[1]
            target = _copy_path(url, validators, name)
            if stable and target.is_file():
                return target  # the same version as the copy we have
            _write_copy(target, lambda handle: _copy(response, handle))
    except urllib.error.HTTPError as exc:
        raise StoreError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StoreError(f"{url}: cannot be fetched ({getattr(exc, 'reason', exc)})") from None
    return target


def _copy(source, handle) -> None:
    while chunk := source.read(COPY_CHUNK_BYTES):
        handle.write(chunk)


def _write_copy(target: Path, fill) -> None:
    """The copy appears whole or not at all (two jobs fetching one object both succeed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".fetching-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            fill(handle)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
