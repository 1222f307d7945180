"""Progress while a job runs: a rich bar on a terminal, plain log lines otherwise.

Before the bar, the startup phases (loading weights, compiling kernels, capturing CUDA graphs,
planning) are shown as they run — a spinner on a terminal, a line at each start and end
otherwise — via `phase_listener` (see `batchinfer.engine.startup`).

Counts samples (rows x n), so the bar is right for n > 1; resumed samples start it
part-way. Throughput and cache hit rate are this run's, from the finished samples, over the
generation time only (from `__enter__`, after startup). No eta is shown until enough of the run
has run to estimate (`progress_time.eta_seconds`), and it reads as 12m05s. Without a terminal a
line is printed every `log_every_seconds` whether or not samples finish (a heartbeat thread), so a
log shows the job is alive while a large unit prefills.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.status import Status

from batchinfer.jobs.outdir.part_writer import SampleResult
from batchinfer.jobs.run.progress_time import ETA_AFTER_SECONDS, Heartbeat, eta_seconds, format_seconds  # noqa: F401


class ProgressReporter:
    def __init__(self, console: Console, job_name: str, total_samples: int, resumed_samples: int,
                 log_every_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.job_name = job_name
        self.total = total_samples
        self.done = resumed_samples
        self.done_this_run = 0
        self.log_every_seconds = log_every_seconds
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._clock = clock
        self._start = clock()  # reset when generation starts (__enter__)
        self._last_log = self._start
        self._bar: Optional[Progress] = None
        self._task = None
        self._status: Optional[Status] = None
        self._heartbeat: Optional[Heartbeat] = None
        self._log_lock = threading.Lock()  # the heartbeat thread and advance() both print lines
        if console.is_terminal:
            self._bar = Progress(
                TextColumn(f"[bold]{job_name}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>8.1f} tok/s"), TextColumn("hit {task.fields[hit]:>6.1%}"),
                TextColumn("eta {task.fields[eta]}"), console=console, transient=False)
            self._task = self._bar.add_task(job_name, total=total_samples, completed=resumed_samples,
                                            rate=0.0, hit=0.0, eta="?")

    def phase_listener(self, label: str, seconds: Optional[float]) -> None:
        """A startup phase began (`seconds` None) or ended after `seconds`."""
        if seconds is None:
            if self.console.is_terminal:
                self._stop_status()
                self._status = self.console.status(f"[{self.job_name}] {label}…")
                self._status.start()
            else:
                self._print(f"[{self.job_name}] {label}…")
            return
        self._stop_status()
        self._print(f"[{self.job_name}] {label}: {seconds:.1f} s")

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _print(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False)

    def __enter__(self) -> "ProgressReporter":
        self._stop_status()
        self._start = self._last_log = self._clock()  # generation starts now: rates and eta from here
        if self._bar is not None:
            self._bar.start()
        else:
            self._print(f"[{self.job_name}] {self.done}/{self.total} samples already done")
            self._heartbeat = Heartbeat(min(1.0, self.log_every_seconds / 4), self._log_if_due).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._bar is not None:
            self._bar.stop()
        else:
            self._log_line()

    @property
    def elapsed(self) -> float:
        """Generation seconds so far."""
        return self._clock() - self._start

    @property
    def output_rate(self) -> float:
        return self.output_tokens / max(self.elapsed, 1e-9)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def eta_seconds(self) -> Optional[float]:
        """Seconds left at this run's sample rate; None until enough has run to estimate."""
        return eta_seconds(self.done_this_run, self.total - (self.done - self.done_this_run), self.elapsed)

    def _eta_text(self) -> str:
        return format_seconds(self.eta_seconds)

    def advance(self, result: SampleResult) -> None:
        self.done += 1
        self.done_this_run += 1
        self.output_tokens += result.completion_tokens
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, rate=self.output_rate, hit=self.hit_rate,
                             eta=self._eta_text())
        else:
            self._log_if_due()

    def _log_if_due(self) -> None:
        with self._log_lock:  # checked under the lock: the heartbeat and advance() may both find it due
            if self._clock() - self._last_log >= self.log_every_seconds:
                self._log_line_locked()

    def _log_line(self) -> None:
        with self._log_lock:
            self._log_line_locked()

    def _log_line_locked(self) -> None:
        self._last_log = self._clock()
        self._print(f"[{self.job_name}] {self.done}/{self.total} samples  {self.output_rate:.1f} tok/s  "
                    f"hit {self.hit_rate:.1%}  elapsed {format_seconds(self.elapsed)}  eta {self._eta_text()}")
