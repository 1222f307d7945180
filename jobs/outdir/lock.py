"""One run per output folder: a lock file naming its holder, kept fresh by a heartbeat.

`_lock.json` in the output folder names the holder (host, pid, start time, a random token)
and is held by the run's parent process for the whole run; workers that commit parts into
the folder (other processes, other hosts) never take it. It works on shared filesystems:

- Creation is atomic: the content is written to a temporary file and hard-linked to the
  lock name (fails if the name exists; the NFS-safe form of O_EXCL). Where hard links are
  not supported, `O_CREAT | O_EXCL`.
- A heartbeat thread refreshes the file's mtime every `HEARTBEAT_SECONDS`.
- A lock is stale when its holder is gone: on the same host (same hostname, boot and pid
  namespace) when the pid is dead or now belongs to another process (its start time
  differs); held from elsewhere, when the heartbeat is older than `STALE_AFTER_SECONDS`,
  measured against the filesystem's own clock (a probe file's mtime), so clock skew
  between hosts does not matter.
- Taking over a stale lock deletes it only under `.lock-guard` (created on the first
  take-over), a POSIX record lock (`lockf`, served by the NFS lock manager on shared
  mounts), and only if the file is still the one judged stale; the take-over then creates
  its own lock like anyone else. Two contenders therefore cannot both win: one creates,
  the other finds a fresh lock.
- Release moves the lock aside, checks it is its own, and links it back if it is not.
- The holder checks on every heartbeat that the lock is still its own; if it was taken
  over (it went unrefreshed for longer than the stale timeout: a suspended host),
  `ensure_held()` raises `LockLost` and the run must stop before committing more parts.
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

from batchinfer.jobs.outdir.lock_holder import LockHolder, _alive, _parse_holder, this_process  # noqa: F401 (API)

try:
    import fcntl
except ImportError:  # not POSIX: take-overs are not serialised beyond the atomic create
    fcntl = None

LOCK_NAME = "_lock.json"
GUARD_NAME = ".lock-guard"
HEARTBEAT_SECONDS = 10.0
STALE_AFTER_SECONDS = 120.0  # twelve missed heartbeats; above NFS's attribute-cache lag (up to 60 s)
GUARD_WAIT_SECONDS = 30.0


class OutputBusy(Exception):
    """The folder is held by a live run."""

    def __init__(self, holder: Optional[LockHolder], heartbeat_age: Optional[float]) -> None:
        self.holder = holder
        self.heartbeat_age = heartbeat_age
        if holder is None:
            what = "is in use (its lock file cannot be read)"
        else:
            what = f"is in use by {holder.describe()}"
        if heartbeat_age is not None:
            what += (f" (last heartbeat {heartbeat_age:.0f} s ago; a lock counts as stale after "
                     f"{STALE_AFTER_SECONDS:.0f} s without one)")
        super().__init__(what)


class LockLost(Exception):
    """Another run took this run's lock over; it must not write more."""


@dataclass(frozen=True)
class _Seen:
    """A lock file as read once: its text (None when unparseable), inode and mtime."""

    text: str
    holder: Optional[LockHolder]
    inode: int
    mtime: float


def _read_lock(path: Path) -> Optional[_Seen]:
    """The lock file as it is now; None when there is none. Whatever is under the name but cannot be a
    live holder's lock (a symlink, dangling or not; a folder; unreadable bytes) is seen with holder None,
    so the usual rule for an unreadable lock applies: stale once its mtime is older than the timeout."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError:  # a symlink (ELOOP), no permission: judged by the name's own mtime
        return _unreadable(path)
    try:
        with os.fdopen(fd, "rb") as handle:
            stat = os.fstat(handle.fileno())
            data = handle.read()
    except OSError:  # e.g. a folder under the lock's name
        return _unreadable(path)
    text = data.decode("utf-8", errors="replace")
    return _Seen(text, _parse_holder(text), stat.st_ino, stat.st_mtime)


def _unreadable(path: Path) -> Optional[_Seen]:
    try:
        stat = os.lstat(path)
    except FileNotFoundError:
        return None
    return _Seen(f"<unreadable: mode {stat.st_mode:o}>", None, stat.st_ino, stat.st_mtime)


def _filesystem_now(folder: Path) -> float:
    """The current time as the folder's filesystem stamps it (an NFS server's clock, say)."""
    probe = folder / f".lock-clock.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        probe.touch()
        try:
            return probe.stat().st_mtime
        finally:
            probe.unlink(missing_ok=True)
    except OSError:
        return time.time()


def _heartbeat_age(seen: _Seen, folder: Path) -> float:
    return max(0.0, _filesystem_now(folder) - seen.mtime)


def _is_stale(seen: _Seen, me: LockHolder, folder: Path, stale_after: float) -> tuple[bool, Optional[float]]:
    """(stale?, heartbeat age when the judgement rested on it)."""
    if seen.holder is not None and seen.holder.same_host(me):
        return not _alive(seen.holder), None
    age = _heartbeat_age(seen, folder)
    return age > stale_after, age


@contextmanager
def _guard(folder: Path) -> Iterator[bool]:
    """Serialise take-overs of the folder's lock; yields False if another holds the guard too long.

    Where record locks are unavailable (no fcntl, an NFS mount with `nolock`) it yields True
    unguarded: the atomic create still keeps two runs from holding the lock at once.
    """
    if fcntl is None:
        yield True
        return
    fd = os.open(folder / GUARD_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + GUARD_WAIT_SECONDS
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except (BlockingIOError, PermissionError):  # held by another contender
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.01)
            except OSError:  # no lock manager
                break
        yield True
    finally:
        os.close(fd)  # closing drops the record lock


def _create(path: Path, text: str) -> bool:
    """Create the lock file holding `text` atomically; False if it exists."""
    temp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    temp.write_text(text, encoding="utf-8")
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # NFS may report an error for a link that took effect (a lost reply): the count tells.
        try:
            if temp.stat().st_nlink == 2:
                return True
        except OSError:
            pass
        return _create_exclusive(path, text)
    finally:
        temp.unlink(missing_ok=True)


def _create_exclusive(path: Path, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    return True


def _make_dirs(folder: Path) -> list[Path]:
    """mkdir -p; → the folders this call created, deepest first (removed again on release if empty)."""
    missing = []
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def live_holder(folder: Path, stale_after: float = STALE_AFTER_SECONDS) -> Optional[LockHolder]:
    """The run holding `folder` now, if a live one does (None: free, or a stale lock; an unreadable
    lock that is still fresh reads as held by an unknown run: a LockHolder is not made up for it)."""
    seen = _read_lock(folder / LOCK_NAME)
    if seen is None or seen.holder is None:
        return None
    stale, _age = _is_stale(seen, this_process(), folder, stale_after)
    return None if stale else seen.holder


class OutputLock:
    """A held output-folder lock; `acquire` it, `release` it (or use it as a context manager)."""

    def __init__(self, folder: Path, holder: LockHolder, text: str, created_dirs: list[Path],
                 heartbeat_seconds: Optional[float]) -> None:
        self.folder = folder
        self.path = folder / LOCK_NAME
        self.holder = holder
        self._text = text
        self._created_dirs = created_dirs
        self._lost = False
        self._released = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if heartbeat_seconds is not None:
            self._thread = threading.Thread(target=self._beat_every, args=(heartbeat_seconds,), daemon=True,
                                            name="output-lock-heartbeat")
            self._thread.start()

    @classmethod
    def acquire(cls, folder: Path, heartbeat_seconds: Optional[float] = HEARTBEAT_SECONDS,
                stale_after: float = STALE_AFTER_SECONDS) -> "OutputLock":
        """Take the folder (creating it), or raise `OutputBusy` naming the live holder."""
        created = _make_dirs(folder)
        path = folder / LOCK_NAME
        me = this_process()
        text = json.dumps(asdict(me), indent=2)
        try:
            for _ in range(10):
                if _create(path, text):
                    return cls(folder, me, text, created, heartbeat_seconds)
                seen = _read_lock(path)
                if seen is None:
                    continue  # released meanwhile
                stale, age = _is_stale(seen, me, folder, stale_after)
                if not stale:
                    raise OutputBusy(seen.holder, age)
                with _guard(folder) as guarded:
                    if not guarded:
                        raise OutputBusy(seen.holder, age)
                    now = _read_lock(path)
                    if now is not None and (now.inode, now.text) == (seen.inode, seen.text):
                        path.unlink(missing_ok=True)  # still the stale one: nobody took it over meanwhile
            raise OutputBusy(seen.holder if seen else None, None)  # lost every round to other runs
        except BaseException:
            _remove_empty(created)
            raise

    def beat(self) -> None:
        """Refresh the heartbeat, or notice the lock is no longer ours."""
        seen = _read_lock(self.path)
        if seen is None or seen.text != self._text:
            self._lost = True
            return
        try:
            os.utime(self.path)
        except OSError:
            pass  # a transient error on a shared mount: the next beat tries again

    def _beat_every(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            self.beat()

    @property
    def lost(self) -> bool:
        """Whether a heartbeat found the lock taken over by another run."""
        return self._lost

    def ensure_held(self) -> None:
        if self._lost:
            raise LockLost(f"{self.path} was taken over by another run")

    def release(self) -> None:
        """Remove the lock if it is still ours (moved aside first, so a take-over's fresh lock is put back)."""
        if self._released or os.getpid() != self.holder.pid:  # a forked worker never releases its parent's lock
            return
        self._released = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        aside = self.folder / f".{LOCK_NAME}.{self.holder.token}.released.tmp"
        try:
            os.rename(self.path, aside)
        except OSError:
            aside = None  # gone already, or the folder turned read-only: nothing to release
        if aside is not None:
            moved = _read_lock(aside)
            if moved is not None and moved.text != self._text:
                try:
                    os.link(aside, self.path)  # another run's lock: give it back
                except OSError:
                    pass
            aside.unlink(missing_ok=True)
        _remove_empty(self._created_dirs)

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _remove_empty(folders: list[Path]) -> None:
    """Remove folders this run created, deepest first, where nothing was put in them."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return
