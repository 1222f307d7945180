"""Progress while a job runs: a rich bar on a terminal, plain log lines otherwise.

Counts samples (rows x n), so the bar is right for n > 1; resumed samples start it
part-way. Throughput and cache hit rate are this run's, from the finished samples.
"""
from __future__ import annotations

import time
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from jobs.outputs import SampleResult


class ProgressReporter:
    def __init__(self, console: Console, job_name: str, total_samples: int, resumed_samples: int,
                 log_every_seconds: float = 10.0) -> None:
        self.console = console
        self.job_name = job_name
        self.total = total_samples
        self.done = resumed_samples
        self.done_this_run = 0
        self.log_every_seconds = log_every_seconds
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._start = time.monotonic()
        self._last_log = self._start
        self._bar: Optional[Progress] = None
        self._task = None
        if console.is_terminal:
            self._bar = Progress(
                TextColumn(f"[bold]{job_name}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>8.1f} tok/s"), TextColumn("hit {task.fields[hit]:>6.1%}"),
                TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)
            self._task = self._bar.add_task(job_name, total=total_samples, completed=resumed_samples,
                                            rate=0.0, hit=0.0)

    def __enter__(self) -> "ProgressReporter":
        if self._bar is not None:
            self._bar.start()
        else:
            self.console.print(f"[{self.job_name}] {self.done}/{self.total} samples already done",
                               highlight=False, markup=False)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.stop()
        else:
            self._log_line()

    @property
    def output_rate(self) -> float:
        return self.output_tokens / max(time.monotonic() - self._start, 1e-9)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def advance(self, result: SampleResult) -> None:
        self.done += 1
        self.done_this_run += 1
        self.output_tokens += result.completion_tokens
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, rate=self.output_rate, hit=self.hit_rate)
        elif time.monotonic() - self._last_log >= self.log_every_seconds:
            self._log_line()

    def _log_line(self) -> None:
        self._last_log = time.monotonic()
        elapsed = self._last_log - self._start
        remaining = self.total - self.done
        eta = f"{remaining * elapsed / self.done_this_run:.0f}s" if self.done_this_run else "?"
        self.console.print(
            f"[{self.job_name}] {self.done}/{self.total} samples  {self.output_rate:.1f} tok/s  "
            f"hit {self.hit_rate:.1%}  elapsed {elapsed:.0f}s  eta {eta}", highlight=False, markup=False)
