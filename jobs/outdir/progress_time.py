"""Time in progress displays: when an eta is worth showing, how a duration reads, and the plain
progress lines printed on time (a heartbeat thread) when no terminal shows a live bar, shared by
the planning pass's progress and the generation's.

The eta extrapolates this run's sample rate, and the first samples say little about it: a global
plan's first unit prefills its whole prefix group before any sample ends, then its samples end in a
burst, so the first sample came after 123 s of a 233 s job and gave "eta 23697s". No eta is shown
until generation has run ETA_AFTER_SECONDS and finished ETA_AFTER_FRACTION of this run's samples.
The prefill eta follows the same rule over the computed (not cached) prompt tokens.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

ETA_AFTER_SECONDS = 5.0
ETA_AFTER_FRACTION = 0.05   # of the samples this run has to do


def eta_seconds(done_this_run: float, to_do_this_run: float, elapsed: float) -> Optional[float]:
    """Seconds left at this run's rate (samples, or computed prompt tokens); None until enough has run
    to estimate (module docstring); 0 once everything is done, however soon."""
    if 0 < to_do_this_run <= done_this_run:
        return 0.0
    if done_this_run <= 0 or elapsed < ETA_AFTER_SECONDS or done_this_run < ETA_AFTER_FRACTION * to_do_this_run:
        return None
    return max(to_do_this_run - done_this_run, 0) * elapsed / done_this_run


def format_seconds(seconds: Optional[float]) -> str:
    """`45s`, `12m05s`, `7h17m`; `?` for None."""
    if seconds is None:
        return "?"
    total = max(int(round(seconds)), 0)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


class Heartbeat:
    """Calls `beat()` about every `interval` seconds on a daemon thread until `stop()`. The callback
    decides whether a line is due (the progress object may have printed one meanwhile)."""

    def __init__(self, interval: float, beat: Callable[[], None]) -> None:
        self.interval, self._beat = interval, beat
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self._beat()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


class PlainLines:
    """A plain progress line at most every `log_every_seconds`, on time whether or not work advances:
    `start_lines()` starts a heartbeat thread, `log_if_due()` (from it or from an advance) prints
    `_line()` when due, `log_now()` at once. Subclasses give `_line()` and may gate on `_lines_due()`."""

    def __init__(self, log_every_seconds: float, clock: Callable[[], float]) -> None:
        self.log_every_seconds = log_every_seconds
        self._clock = clock
        self._last_log = clock()
        self._heartbeat: Optional[Heartbeat] = None
        self._log_lock = threading.Lock()  # the heartbeat thread and advances both print lines

    def start_lines(self) -> None:
        self._last_log = self._clock()
        self._heartbeat = Heartbeat(min(1.0, self.log_every_seconds / 4), self.log_if_due).start()

    def stop_lines(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def log_if_due(self) -> None:
        with self._log_lock:  # checked under the lock: the heartbeat and an advance may both find it due
            if self._lines_due() and self._clock() - self._last_log >= self.log_every_seconds:
                self._log_locked()

    def log_now(self) -> None:
        with self._log_lock:
            self._log_locked()

    def _log_locked(self) -> None:
        self._last_log = self._clock()
        self._print_line(self._line())

    def _lines_due(self) -> bool:
        return True

    def _line(self) -> str:
        raise NotImplementedError

    def _print_line(self, line: str) -> None:
        raise NotImplementedError
