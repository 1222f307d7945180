"""Committing a part under its final name through a pyarrow filesystem (local path or object store).

Every write goes to a dot-prefixed temporary name first (dataset readers skip dot-names), and the
final name appears only once the temporary is complete:
- local filesystem: fsync, then rename (atomic; replaces an older copy of the same name);
- object stores (S3, GCS, ...; no rename exists there): copy the temporary to the final name, then
  delete the temporary. A server-side copy creates the object whole or not at all, so a reader never
  sees a partial part; writing straight to the final name is avoided because a stream closed while
  an exception unwinds can complete the upload with what was written so far. A crash between the
  copy and the delete leaves an orphan dot-name, which readers skip and the next commit overwrites.
The rule for readers on either: a part is final once its final name exists.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

TEMP_SUFFIX = ".tmp"


class PartStore:
    """A folder of parts on a pyarrow filesystem; names are relative to `root`."""

    def __init__(self, filesystem: pafs.FileSystem, root: str, atomic_rename: Optional[bool] = None) -> None:
        self.fs = filesystem
        self.root = root.rstrip("/")
        self.atomic_rename = isinstance(filesystem, pafs.LocalFileSystem) if atomic_rename is None else atomic_rename

    @classmethod
    def open(cls, path_or_uri: str) -> "PartStore":
        """A plain path is the local filesystem; a URI (s3://, gs://, file://, ...) picks its filesystem."""
        if "://" not in path_or_uri:
            return cls(pafs.LocalFileSystem(), os.path.abspath(path_or_uri))
        filesystem, root = pafs.FileSystem.from_uri(path_or_uri)
        return cls(filesystem, root)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        return self.fs.get_file_info(self.path(name)).type == pafs.FileType.File

    def commit(self, name: str, write: Callable[[pa.NativeFile], None]) -> None:
        """`write(stream)` the part's bytes to a temporary, then publish it under `name`."""
        self.fs.create_dir(self.root, recursive=True)
        final = self.path(name)
        temp = self.path(f".{name}{TEMP_SUFFIX}")
        try:
            with self.fs.open_output_stream(temp) as stream:
                write(stream)
            if self.atomic_rename:
                if isinstance(self.fs, pafs.LocalFileSystem):
                    _fsync(temp)  # durable before it becomes visible
                self.fs.move(temp, final)
            else:
                self.fs.copy_file(temp, final)
                self.fs.delete_file(temp)
        except BaseException:
            try:
                self.fs.delete_file(temp)
            except (OSError, FileNotFoundError):
                pass
            raise

    def commit_table(self, name: str, table: pa.Table) -> None:
        self.commit(name, lambda stream: pq.write_table(table, stream))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
