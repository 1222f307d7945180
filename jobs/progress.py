"""Progress while a job runs: a rich bar on a terminal, plain log lines otherwise.

Before the bar, the startup phases (loading weights, compiling kernels, capturing CUDA graphs,
planning) are shown as they run — a spinner on a terminal, a line at each start and end
otherwise — via `phase_listener` (see `batchinfer.engine.startup`).

Counts samples (rows x n), so the bar is right for n > 1; resumed samples start it
part-way. Throughput and cache hit rate are this run's, from the finished samples, over the
generation time only (from `__enter__`, after startup). No eta is shown until generation has run
ETA_AFTER_SECONDS and finished a sample: the first samples finish in a burst or late, and an
estimate from them is off by orders of magnitude.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.status import Status

from batchinfer.jobs.outputs import SampleResult

ETA_AFTER_SECONDS = 5.0


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
        return self

    def __exit__(self, *exc_info: object) -> None:
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
        """Seconds left at this run's sample rate; None until there is a rate worth the name."""
        elapsed = self.elapsed
        if self.done_this_run == 0 or elapsed < ETA_AFTER_SECONDS:
            return None
        return (self.total - self.done) * elapsed / self.done_this_run

    def _eta_text(self) -> str:
        eta = self.eta_seconds
        return "?" if eta is None else f"{eta:.0f}s"

    def advance(self, result: SampleResult) -> None:
        self.done += 1
        self.done_this_run += 1
        self.output_tokens += result.completion_tokens
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, rate=self.output_rate, hit=self.hit_rate,
                             eta=self._eta_text())
        elif self._clock() - self._last_log >= self.log_every_seconds:
            self._log_line()

    def _log_line(self) -> None:
        self._last_log = self._clock()
        self._print(f"[{self.job_name}] {self.done}/{self.total} samples  {self.output_rate:.1f} tok/s  "
                    f"hit {self.hit_rate:.1%}  elapsed {self.elapsed:.0f}s  eta {self._eta_text()}")
