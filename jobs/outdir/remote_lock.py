"""The lock of an s3:// output folder: the object `<folder>/_lock.json`, naming its holder as the local
lock file does (`lock_holder.py`), created with a conditional PUT (`If-None-Match: *`), so of two runs
only one creates it; pyarrow's filesystem has no conditional write, so these go through boto3 (`s3_client.py`,
imported here only when a lock is taken: boto3 is the optional `s3` extra).

- The heartbeat rewrites the object with `If-Match: <its ETag>`: a run whose lock was taken over
  finds out on its next beat (412) and must stop before committing more (`lost`).
- A lock is stale when its holder is gone: on this host when its pid is dead (a killed run's
  rerun takes over at once), from elsewhere when it went unrefreshed for `STALE_AFTER_SECONDS`,
  measured on the server's clock (its Date minus the object's Last-Modified).
- A take-over is a PUT with `If-Match: <the stale lock's ETag>`: of two contenders one replaces
  it, the other's precondition fails and it looks again (then sees a fresh lock).
- Release deletes the object with `If-Match: <its ETag>`: never another run's lock.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Optional

from batchinfer.jobs.outdir.lock import STALE_AFTER_SECONDS, OutputBusy
from batchinfer.jobs.outdir.lock_holder import LockHolder, _alive, _parse_holder, this_process
from batchinfer.jobs.outdir.object_store import StoreError

if TYPE_CHECKING:
    from batchinfer.jobs.outdir.s3_client import S3Object

LOCK_NAME = "_lock.json"
PRECONDITION_FAILED = (409, 412)  # 409: S3's ConditionalRequestConflict, a concurrent conditional write


def _stale(holder: Optional[LockHolder], age: Optional[float], me: LockHolder,
           stale_after: float) -> tuple[bool, Optional[float]]:
    if holder is not None and holder.same_host(me):
        return not _alive(holder), None
    return (age or 0.0) > stale_after, age


class RemoteLock:
    """A held lock object; `beat` keeps it fresh, `release` deletes it."""

    def __init__(self, target: "S3Object", holder: LockHolder, body: bytes, etag: Optional[str]) -> None:
        self.target, self.holder, self._body, self._etag = target, holder, body, etag

    @classmethod
    def acquire(cls, folder_url: str, stale_after: float = STALE_AFTER_SECONDS) -> "RemoteLock":
        """Take the folder, or raise OutputBusy naming the live holder (StoreError: the store refused)."""
        from batchinfer.jobs.outdir.s3_client import S3Object  # the s3 extra, checked at validation

        target = S3Object(f"{folder_url}/{LOCK_NAME}")
        me = this_process()
        body = json.dumps(asdict(me), indent=2).encode()
        holder: Optional[LockHolder] = None
        for _ in range(10):
            created = target.put(body, if_none_match=True)
            if created.status == 200:
                return cls(target, me, body, created.etag)
            if created.status not in PRECONDITION_FAILED:
                raise StoreError(f"{folder_url}: its lock object cannot be written (HTTP {created.status})")
            seen = target.get()
            if seen.status == 404:
                continue  # released meanwhile
            holder = _parse_holder(seen.body.decode("utf-8", errors="replace"))
            stale, age = _stale(holder, seen.age_seconds, me, stale_after)
            if not stale:
                raise OutputBusy(holder, age)
            taken = target.put(body, if_match=seen.etag)
            if taken.status == 200:
                return cls(target, me, body, taken.etag)
        raise OutputBusy(holder, None)  # lost every round to other runs

    def beat(self) -> bool:
        """Refresh the lock; False when it is no longer ours (taken over, or deleted)."""
        refreshed = self.target.put(self._body, if_match=self._etag)
        if refreshed.status == 200:
            self._etag = refreshed.etag
            return True
        return refreshed.status not in (404, *PRECONDITION_FAILED)  # anything else: try again next beat

    def release(self) -> None:
        self.target.delete(if_match=self._etag)  # 412: another run's lock now, left alone
