"""How a run stops on a signal: one policy for SIGINT (Ctrl-C), SIGTERM and SIGHUP (a dropped session).

    with stop_on_signals():          # the CLI's run; a worker process: stop_on_signals((SIGTERM,), StopRequested)
        ...
        with commit_section():       # a part's commit and its accounting: a signal waits for its end
            commit_part(...); counters += ...

Each stop signal raises `Stopped` in the main thread, wherever it runs (Python runs handlers between
bytecodes), so the run ends as it ends on Ctrl-C: every finished sample committed, `_stats.json`
saying interrupted (`interrupted_by`), the folder's lock released, exit 128 + the signal's number.
After the first stop signal the others are ignored, so a second Ctrl-C or the SIGHUP that follows a
SIGTERM cannot cut the final flush short. A signal that arrives inside `commit_section` is held
until the section ends: a part is either on disk and counted, or neither.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Stopped(BaseException):
    """A stop signal, raised in the main thread (a BaseException, like KeyboardInterrupt: not a failure)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signal_name = signal_name(signum)
        super().__init__(self.signal_name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_signal_of(exc: BaseException) -> Optional[int]:
    """The signal that `exc` stands for: Stopped's, SIGINT for a KeyboardInterrupt, else None."""
    if isinstance(exc, Stopped):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return None


class _Policy:
    """The process's stop state; signal dispositions are process-wide, so this is one object too."""

    def __init__(self) -> None:
        self.raise_as: Callable[[int], BaseException] = Stopped
        self.stopping: Optional[int] = None   # the stop signal already raised
        self.held: Optional[int] = None       # a stop signal that arrived inside a commit section
        self.depth = 0                        # nested commit sections

    def on_signal(self, signum: int, frame: object) -> None:
        if self.stopping is not None:  # already stopping: let the flush finish
            return
        if self.depth:
            self.held = self.held or signum
            return
        self.stopping = signum
        raise self.raise_as(signum)


_POLICY = _Policy()


@contextmanager
def stop_on_signals(signals: Sequence[int] = STOP_SIGNALS,
                    raise_as: Callable[[int], BaseException] = Stopped) -> Iterator[None]:
    """While inside, each of `signals` raises `raise_as(signum)` in the main thread (once).
    Outside the main thread (an embedding caller) signals are left to the caller."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _POLICY.on_signal) for signum in signals}
    _POLICY.raise_as, _POLICY.stopping, _POLICY.held = raise_as, None, None
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _POLICY.raise_as, _POLICY.stopping, _POLICY.held = Stopped, None, None


@contextmanager
def commit_section() -> Iterator[None]:
    """A stop signal arriving inside waits for the section's end, then stops the run as usual."""
    _POLICY.depth += 1
    try:
        yield
    finally:
        _POLICY.depth -= 1
        held = _POLICY.held
        if not _POLICY.depth and held is not None and _POLICY.stopping is None:
            _POLICY.held, _POLICY.stopping = None, held
            raise _POLICY.raise_as(held)
