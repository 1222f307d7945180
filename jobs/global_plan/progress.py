"""Progress of the planning pass: rows per phase, rate and ETA; a rich bar on a terminal, plain lines otherwise.

Phases: `tokenise` (input rows to prompt keys, spilled in sorted runs), `sort` (the runs
merged into the globally sorted rows). Cutting units reads two integer columns and takes
a moment, so it has no bar. Without a terminal a line is printed every `log_every_seconds` while a
phase runs, also when a slow batch of rows is in between (`progress_time.PlainLines`, as the
generation's progress); etas read as 12m05s.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from batchinfer.jobs.outdir.progress_time import PlainLines, format_seconds


class PlanningProgress(PlainLines):
    def __init__(self, console: Console, job_name: str, log_every_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(log_every_seconds, clock)
        self.console = console
        self.job_name = job_name
        self._bar: Optional[Progress] = None
        self._task: Optional[TaskID] = None
        self._phase: Optional[str] = None
        self._total = 0
        self._done = 0
        self._tokens = 0
        self._start = clock()
        if console.is_terminal:
            self._bar = Progress(TextColumn(f"[bold]{job_name}[/] plan: {{task.description}}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[rate]:>9,.0f} rows/s"),
                                 TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)

    def __enter__(self) -> "PlanningProgress":
        if self._bar is not None:
            self._bar.start()
        else:
            self.start_lines()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_lines()
        self._end_phase()
        if self._bar is not None:
            self._bar.stop()

    @property
    def rate(self) -> float:
        return self._done / max(self._clock() - self._start, 1e-9)

    def phase(self, name: str, total_rows: int) -> None:
        """Start phase `name` over `total_rows` rows (ends the one before)."""
        self._end_phase()
        with self._log_lock:
            self._phase, self._total, self._done, self._tokens = name, total_rows, 0, 0
            self._start = self._last_log = self._clock()
        if self._bar is not None:
            self._task = self._bar.add_task(name, total=total_rows, rate=0.0)

    def advance(self, rows: int, tokens: int = 0) -> None:
        self._done += rows
        self._tokens += tokens
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self._done, rate=self.rate)
        elif self._bar is None:
            self.log_if_due()

    def _lines_due(self) -> bool:
        return self._phase is not None

    def _line(self) -> str:
        elapsed = self._clock() - self._start
        eta = format_seconds((self._total - self._done) / self.rate if self._done else None)
        tokens = f"  {self._tokens:,} tokens" if self._tokens else ""
        return (f"{self._phase} {self._done:,}/{self._total:,} rows{tokens}  {self.rate:,.0f} rows/s  "
                f"elapsed {format_seconds(elapsed)}  eta {eta}")

    def _end_phase(self) -> None:
        with self._log_lock:
            if self._phase is None:
                return
            if self._bar is None:
                elapsed = self._clock() - self._start
                self._print_line(f"{self._phase} done: {self._done:,} rows in {elapsed:.1f}s ({self.rate:,.0f} rows/s)")
            self._phase = None

    def _print_line(self, line: str) -> None:
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
