"""Progress of the planning pass: rows per phase, rate and ETA; a rich bar on a terminal, plain lines otherwise.

Phases: `tokenise` (input rows to prompt keys, spilled in sorted runs), `sort` (the runs
merged into the globally sorted rows). Cutting units reads two integer columns and takes
a moment, so it has no bar. Without a terminal a line is printed every `log_every_seconds` while a
phase runs, also when a slow batch of rows is in between (a heartbeat thread); etas read as 12m05s.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from batchinfer.jobs.outdir.progress_time import Heartbeat, format_seconds


class PlanningProgress:
    def __init__(self, console: Console, job_name: str, log_every_seconds: float = 10.0) -> None:
        self.console = console
        self.job_name = job_name
        self.log_every_seconds = log_every_seconds
        self._bar: Optional[Progress] = None
        self._task: Optional[TaskID] = None
        self._phase: Optional[str] = None
        self._total = 0
        self._done = 0
        self._tokens = 0
        self._start = self._last_log = time.monotonic()
        self._heartbeat: Optional[Heartbeat] = None
        self._lock = threading.Lock()  # the heartbeat thread and advance() both print lines
        if console.is_terminal:
            self._bar = Progress(TextColumn(f"[bold]{job_name}[/] plan: {{task.description}}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[rate]:>9,.0f} rows/s"),
                                 TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)

    def __enter__(self) -> "PlanningProgress":
        if self._bar is not None:
            self._bar.start()
        else:
            self._heartbeat = Heartbeat(min(1.0, self.log_every_seconds / 4), self._log_if_due).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self._end_phase()
        if self._bar is not None:
            self._bar.stop()

    @property
    def rate(self) -> float:
        return self._done / max(time.monotonic() - self._start, 1e-9)

    def phase(self, name: str, total_rows: int) -> None:
        """Start phase `name` over `total_rows` rows (ends the one before)."""
        self._end_phase()
        with self._lock:
            self._phase, self._total, self._done, self._tokens = name, total_rows, 0, 0
            self._start = self._last_log = time.monotonic()
        if self._bar is not None:
            self._task = self._bar.add_task(name, total=total_rows, rate=0.0)

    def advance(self, rows: int, tokens: int = 0) -> None:
        self._done += rows
        self._tokens += tokens
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self._done, rate=self.rate)
        elif self._bar is None:
            self._log_if_due()

    def _log_if_due(self) -> None:
        with self._lock:  # checked under the lock: the heartbeat and advance() may both find it due
            if self._phase is not None and time.monotonic() - self._last_log >= self.log_every_seconds:
                self._log_line()

    def _log_line(self) -> None:
        self._last_log = time.monotonic()
        elapsed = self._last_log - self._start
        eta = format_seconds((self._total - self._done) / self.rate if self._done else None)
        tokens = f"  {self._tokens:,} tokens" if self._tokens else ""
        self._print(f"{self._phase} {self._done:,}/{self._total:,} rows{tokens}  {self.rate:,.0f} rows/s  "
                    f"elapsed {format_seconds(elapsed)}  eta {eta}")

    def _end_phase(self) -> None:
        with self._lock:
            if self._phase is None:
                return
            if self._bar is None:
                elapsed = time.monotonic() - self._start
                self._print(f"{self._phase} done: {self._done:,} rows in {elapsed:.1f}s ({self.rate:,.0f} rows/s)")
            self._phase = None

    def _print(self, line: str) -> None:
        self.console.print(f"[{self.job_name}] plan: {line}", highlight=False, markup=False)


class NoProgress:
    """The same interface, silent (library use, tests)."""

    def __enter__(self) -> "NoProgress":
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def phase(self, name: str, total_rows: int) -> None:
        pass

    def advance(self, rows: int, tokens: int = 0) -> None:
        pass
