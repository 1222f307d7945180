"""Lock files that no live run could have written (JSON that is not a holder, a symlink, wrong types)
follow the rule of an unreadable lock: busy while their mtime is fresh, taken over once it is stale."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from batchinfer.jobs.outdir.lock import LOCK_NAME, STALE_AFTER_SECONDS, OutputBusy, OutputLock


def age(path: Path, seconds: float) -> None:
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp), follow_symlinks=False)


INVALID = {
    "a list": "[1, 2]",
    "null": "null",
    "a string": '"held"',
    "a number": "7",
    "wrong field types": json.dumps({"host": 1, "pid": True, "started": "now", "token": "t"}),
    "a pid that is not a number": json.dumps({"host": "h", "pid": "12", "started": 1.0, "token": "t"}),
    "bytes that are not UTF-8": b"\xff\xfe{\x00",
}


@pytest.mark.parametrize("content", INVALID.values(), ids=INVALID.keys())
def test_an_invalid_lock_is_busy_while_fresh_and_taken_over_once_stale(tmp_path, content):
    path = tmp_path / LOCK_NAME
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(OutputBusy, match="its lock file cannot be read"):
        OutputLock.acquire(tmp_path, heartbeat_seconds=None)
    age(path, STALE_AFTER_SECONDS + 5)
    with OutputLock.acquire(tmp_path, heartbeat_seconds=None) as lock:
        assert json.loads(path.read_text())["token"] == lock.holder.token
    assert not path.exists()


@pytest.mark.parametrize("target", ["nowhere", "elsewhere.json"], ids=["dangling", "to a file"])
def test_a_symlink_as_the_lock_is_taken_over_once_stale_and_its_target_left_alone(tmp_path, target):
    path = tmp_path / LOCK_NAME
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(target, path)
    with pytest.raises(OutputBusy, match="its lock file cannot be read"):
        OutputLock.acquire(tmp_path, heartbeat_seconds=None)
    age(path, STALE_AFTER_SECONDS + 5)
    with OutputLock.acquire(tmp_path, heartbeat_seconds=None) as lock:
        assert not path.is_symlink() and json.loads(path.read_text())["token"] == lock.holder.token
    assert not os.path.lexists(path) and (tmp_path / "elsewhere.json").read_text() == "{}"
