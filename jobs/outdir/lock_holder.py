"""Who holds an output folder: the `LockHolder` a lock names (host, pid, start time, token), and
whether that process still runs on this host. Shared by the folder lock (`lock.py`) and the lock
object of a remote output folder (`remote_lock.py`).
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LockHolder:
    """Who holds an output folder, as written in its lock file."""

    host: str
    pid: int
    started: float                 # unix time the lock was taken
    token: str                     # random: tells this holder's lock from any other
    boot_id: Optional[str] = None  # with host and pid_ns: "the same host" for pid checks
    pid_ns: Optional[str] = None
    pid_start: Optional[int] = None  # the process's start time (clock ticks since boot)

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on host {self.host} since {since}"

    def same_host(self, other: "LockHolder") -> bool:
        return (self.host, self.boot_id, self.pid_ns) == (other.host, other.boot_id, other.pid_ns)


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return None


def _process_state(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, start time in clock ticks since boot) from /proc, None where unknown."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def this_process() -> LockHolder:
    try:
        pid_ns: Optional[str] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    state = _process_state(os.getpid())
    return LockHolder(host=socket.gethostname(), pid=os.getpid(), started=time.time(), token=uuid.uuid4().hex,
                      boot_id=_read_text("/proc/sys/kernel/random/boot_id"), pid_ns=pid_ns,
                      pid_start=state[1] if state else None)


def _alive(holder: LockHolder) -> bool:
    """Whether the holder's process still runs (on this host)."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    state = _process_state(holder.pid)
    if state is None:
        return True
    letter, start = state
    return letter not in ("Z", "X") and (holder.pid_start is None or start == holder.pid_start)


# Each field of a lock file and the types it may hold (bool is an int to isinstance: refused apart).
_HOLDER_TYPES = {"host": (str,), "pid": (int,), "started": (int, float), "token": (str,),
                 "boot_id": (str, type(None)), "pid_ns": (str, type(None)), "pid_start": (int, type(None))}


def _parse_holder(text: str) -> Optional[LockHolder]:
    """The holder a lock file names; None for anything else (half written, foreign, not an object)."""
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    if not isinstance(raw, dict):
        return None
    values = {key: raw.get(key) for key in _HOLDER_TYPES}
    for key, types in _HOLDER_TYPES.items():
        if not isinstance(values[key], types) or isinstance(values[key], bool):
            return None
    return LockHolder(**values)
