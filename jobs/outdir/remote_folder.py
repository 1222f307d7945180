"""An s3:// output folder: the job writes a local staging folder (jobs/spec/urls.py `staging_folder`)
through the whole local code path, and this module mirrors it to the bucket in commit order.

- On start (`pull_output` when the job is prepared, again under the lock) the remote folder is
  synced down: manifest, stats, parts and their records, so resume and exactly-once work as for a
  local folder; local files the remote folder lacks are removed (the remote folder is the truth),
  and a remote part without its record (an upload cut short) is deleted under the lock.
- While the job runs (`RemoteOutputLock`: before every commit, every `PUSH_SECONDS`, on release)
  changes are pushed: deletions first (records before their parts, `_compact.json` last), then
  the manifest, `_compact.json`, parts, their records, the rest. A part is uploaded before the
  record that names it and S3 objects appear whole, so a kill at any moment leaves a folder that
  resumes: a row is either in a recorded part or redone, never both.
- Two runs: the lock object (`remote_lock.py`) on the bucket, besides the staging folder's own lock.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.fs as pafs

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.outdir.lock import GUARD_NAME, HEARTBEAT_SECONDS, LockLost, OutputBusy, OutputLock, live_holder
from batchinfer.jobs.outdir.object_store import Store, StoreError, open_store
from batchinfer.jobs.outdir.part_store import PARTS_DIR, RECORD_SUFFIX, is_part_name
from batchinfer.jobs.outdir.remote_lock import LOCK_NAME, RemoteLock
from batchinfer.jobs.outdir.resume import COMPACT_NAME, MANIFEST_NAME

PUSH_SECONDS = 2.0        # a killed run loses at most this long of locally committed parts (they are redone)
WORK_DIR_NAME = "_work"   # the planning folder (jobs/global_plan/store.py): local scratch, never mirrored
COPY_CHUNK_BYTES = 8 << 20
PUSH_RETRY_SECONDS = (1.0, 4.0, None)  # a commit waits out a short outage of the store, then the run fails


def _ignored(relative: str) -> bool:
    first, name = relative.split("/", 1)[0], relative.rsplit("/", 1)[-1]
    return first in (LOCK_NAME, GUARD_NAME, WORK_DIR_NAME) or name.startswith(".")


def _is_record(relative: str) -> bool:
    return relative.startswith(f"{PARTS_DIR}/")


def _is_part(relative: str) -> bool:
    return "/" not in relative and is_part_name(relative)


def _upload_rank(relative: str) -> int:
    order = {MANIFEST_NAME: 0, COMPACT_NAME: 1}
    if relative in order:
        return order[relative]
    return 3 if _is_record(relative) else 2 if not relative.startswith("_") else 4


def _delete_rank(relative: str) -> int:
    return 0 if _is_record(relative) else 2 if relative == COMPACT_NAME else 1


class Mirror:
    """The staging folder and its remote folder, with what is known to be the same on both."""

    def __init__(self, store: Store, folder: Path) -> None:
        self.store, self.folder = store, folder
        self._synced: dict[str, tuple[int, int]] = {}  # relative name -> local (size, mtime_ns) as uploaded
        self._mutex = threading.Lock()

    def _remote(self) -> dict[str, pafs.FileInfo]:
        selector = pafs.FileSelector(self.store.path, recursive=True, allow_not_found=True)
        entries = self.store.filesystem.get_file_info(selector)
        found = {}
        for entry in entries:
            relative = entry.path[len(self.store.path) + 1:]
            if entry.type == pafs.FileType.File and not _ignored(relative):
                found[relative] = entry
        return found

    def _local(self) -> dict[str, tuple[int, int]]:
        found = {}
        for root, folders, files in os.walk(self.folder):
            base = Path(root).relative_to(self.folder).as_posix()
            folders[:] = [name for name in folders if not _ignored(name if base == "." else f"{base}/{name}")]
            for name in files:
                relative = name if base == "." else f"{base}/{name}"
                if not _ignored(relative):
                    stat = os.stat(os.path.join(root, name))
                    found[relative] = (stat.st_size, stat.st_mtime_ns)
        return found

    def pull(self, clean_remote: bool) -> None:
        """Make the staging folder what the remote folder holds (StoreError when the store fails)."""
        with self._mutex:
            try:
                self._pull(clean_remote)
            except (pa.ArrowException, OSError) as exc:
                raise StoreError(f"{self.store.url}: cannot be synced down ({exc})") from None

    def _pull(self, clean_remote: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        remote = self._remote()
        orphans = [name for name in remote if _is_part(name) and f"{PARTS_DIR}/{name}{RECORD_SUFFIX}" not in remote]
        for name in orphans:
            del remote[name]
            if clean_remote:
                self.store.filesystem.delete_file(self.store.child(name))
        local = self._local()
        for name in sorted(set(local) - set(remote), key=_delete_rank):
            (self.folder / name).unlink(missing_ok=True)
        self._synced.clear()
        for name, entry in sorted(remote.items(), key=lambda item: _upload_rank(item[0])):
            immutable = _is_part(name) or _is_record(name)  # a part or record never changes under its name
            if not (immutable and name in local and local[name][0] == entry.size):
                self._download(name)
            stat = (self.folder / name).stat()
            self._synced[name] = (stat.st_size, stat.st_mtime_ns)

    def _download(self, name: str) -> None:
        target = self.folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.pull-", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle, \
                    self.store.filesystem.open_input_stream(self.store.child(name)) as source:
                while chunk := source.read(COPY_CHUNK_BYTES):
                    handle.write(chunk)
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def push(self) -> None:
        """Send the staging folder's changes since the last sync, in commit order."""
        with self._mutex:
            try:
                self._push()
            except (pa.ArrowException, OSError) as exc:
                raise StoreError(f"{self.store.url}: cannot be uploaded to ({exc})") from None

    def _push(self) -> None:
        local = self._local()
        if MANIFEST_NAME in self._synced and MANIFEST_NAME not in local and not self.folder.is_dir():
            # the staging folder was deleted under the run: mirroring that would empty the bucket's folder
            raise StoreError(f"{self.store.url}: its staging folder {self.folder} is gone; not mirrored")
        for name in sorted((name for name in self._synced if name not in local), key=_delete_rank):
            try:
                self.store.filesystem.delete_file(self.store.child(name))
            except FileNotFoundError:
                pass
            del self._synced[name]
        changed = [name for name, stamp in local.items() if self._synced.get(name) != stamp]
        for name in sorted(changed, key=lambda name: (_upload_rank(name), name)):
            if self._upload(name):
                self._synced[name] = local[name]

    def _upload(self, name: str) -> bool:
        """`name` under its final key whole or not at all; False when it vanished locally meanwhile.

        Written to a dot-key first, then moved (a server-side copy): a stream closed while an exception
        unwinds completes the upload with what it holds, which must never be a part's final key."""
        folder, _, base = name.rpartition("/")
        temporary = self.store.child(f"{folder}/.{base}.upload.tmp" if folder else f".{base}.upload.tmp")
        try:
            with open(self.folder / name, "rb") as source, self.store.filesystem.open_output_stream(temporary) as sink:
                while chunk := source.read(COPY_CHUNK_BYTES):
                    sink.write(chunk)
        except FileNotFoundError:
            return False  # removed meanwhile (a compaction): the next push deletes it remotely if it was there
        self.store.filesystem.move(temporary, self.store.child(name))
        return True


def _job_error(spec, what: str) -> JobError:
    return JobError(spec.job_file, spec.where("output.path"), what)


def pull_output(spec) -> None:
    """The remote folder synced into the staging folder before the job's resume check (JobError if the
    store fails); skipped while a run on this host holds the staging folder (the lock then refuses)."""
    if live_holder(spec.output.path) is not None:
        return
    try:
        Mirror(open_store(spec.output.remote), spec.output.path).pull(clean_remote=False)
    except StoreError as exc:
        raise _job_error(spec, str(exc)) from None


class RemoteOutputLock:
    """What the runner holds for an s3:// output: the lock object, the staging folder's lock, and the
    mirror, pushed before every commit (`ensure_held`), every PUSH_SECONDS and on release."""

    def __init__(self, remote: RemoteLock, local: OutputLock, mirror: Mirror) -> None:
        self.remote, self.local, self.mirror = remote, local, mirror
        self.path = local.path
        self._lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True, name="remote-output-sync")
        self._thread.start()

    @classmethod
    def acquire(cls, spec) -> "RemoteOutputLock":
        url = spec.output.remote
        try:
            store = open_store(url)
            remote = RemoteLock.acquire(url)
        except StoreError as exc:
            raise _job_error(spec, str(exc)) from None
        except OutputBusy as busy:
            raise _job_error(spec, f"{url} {busy}; wait for that run to end, or stop it") from None
        try:
            local = OutputLock.acquire(spec.output.path)
        except BaseException:
            remote.release()
            raise
        try:
            mirror = Mirror(store, spec.output.path)
            mirror.pull(clean_remote=True)
        except BaseException as exc:
            local.release()
            remote.release()
            if isinstance(exc, StoreError):
                raise _job_error(spec, str(exc)) from None
            raise
        return cls(remote, local, mirror)

    def _tick(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(PUSH_SECONDS):
            try:
                if time.monotonic() - last_beat >= HEARTBEAT_SECONDS:
                    last_beat = time.monotonic()
                    if not self.remote.beat():
                        self._lost = True
                        return
                self.mirror.push()
            except StoreError:
                pass  # a transient failure: the next tick, commit or the release tries again

    @property
    def lost(self) -> bool:
        return self._lost or self.local.lost

    def ensure_held(self) -> None:
        if self.lost:
            raise LockLost(f"{self.remote.target.url} was taken over by another run")
        self.local.ensure_held()
        for delay in PUSH_RETRY_SECONDS:  # every commit so far is remote before the next one is made
            try:
                self.mirror.push()
                return
            except StoreError:
                if delay is None:
                    raise
                time.sleep(delay)

    def release(self) -> None:
        if self._stop.is_set() or os.getpid() != self.local.holder.pid:
            return
        self._stop.set()
        self._thread.join()
        try:
            if not self._lost:
                self.mirror.push()
        except StoreError as exc:
            print(f"warning: {exc}; the staging folder {self.local.folder} keeps the rest, rerun to resume",
                  file=sys.stderr, flush=True)
        finally:
            self.local.release()
            try:
                self.remote.release()
            except StoreError:
                pass  # unreleased, it goes stale: a rerun on this host takes it over at once

    def __enter__(self) -> "RemoteOutputLock":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_remote_output(spec) -> Optional[RemoteOutputLock]:
    return RemoteOutputLock.acquire(spec) if spec.output.remote else None
