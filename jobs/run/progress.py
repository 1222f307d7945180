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

Prompt tokens/s counts the computed prompt tokens (prompt minus cached) of the finished samples; given
the plan's computed prompt tokens for this run (`set_prefill_total`, `computed_tokens_to_do`), a
prefill eta for what is left of them follows the same rule as the samples' eta.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.status import Status

from batchinfer.jobs.outdir.part_writer import SampleResult
from batchinfer.jobs.outdir.progress_time import ETA_AFTER_SECONDS, PlainLines, eta_seconds, format_seconds  # noqa: F401


def computed_tokens_to_do(summary: Any, total_samples: int, resumed_samples: int) -> int:
    """The computed prompt tokens a global plan leaves this run: what its units compute (prompt minus
    the units' ideal cached tokens), less the share of the samples resumed from disk."""
    computed = max(int(summary.prompt_tokens) - int(summary.unit_ideal_cached_tokens), 0)
    if total_samples <= 0:
        return 0
    return round(computed * max(total_samples - resumed_samples, 0) / total_samples)


class ProgressReporter(PlainLines):
    def __init__(self, console: Console, job_name: str, total_samples: int, resumed_samples: int,
                 log_every_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 prefill_total_tokens: Optional[int] = None) -> None:
        super().__init__(log_every_seconds, clock)
        self.console = console
        self.job_name = job_name
        self.total = total_samples
        self.done = resumed_samples
        self.done_this_run = 0
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefill_total_tokens = prefill_total_tokens  # computed prompt tokens this run has to do
        self._start = clock()  # reset when generation starts (__enter__)
        self._bar: Optional[Progress] = None
        self._task = None
        self._status: Optional[Status] = None
        if console.is_terminal:
            self._bar = Progress(
                TextColumn(f"[bold]{job_name}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>8.1f} tok/s"), TextColumn("prompt {task.fields[prompt_rate]:>9,.0f} tok/s"),
                TextColumn("hit {task.fields[hit]:>6.1%}"), TextColumn("{task.fields[prefill]}"),
                TextColumn("eta {task.fields[eta]}"), console=console, transient=False)
            self._task = self._bar.add_task(job_name, total=total_samples, completed=resumed_samples,
                                            rate=0.0, prompt_rate=0.0, hit=0.0, prefill=self._prefill_text(), eta="?")

    def set_prefill_total(self, computed_tokens: int) -> None:
        """The computed prompt tokens the plan leaves this run (`computed_tokens_to_do`): turns on the prefill eta."""
        self.prefill_total_tokens = int(computed_tokens)
        if self._bar is not None:
            self._bar.update(self._task, prefill=self._prefill_text())

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
        self._start = self._clock()  # generation starts now: rates and eta from here
        if self._bar is not None:
            self._bar.start()
        else:
            self._print(f"[{self.job_name}] {self.done}/{self.total} samples already done")
            self.start_lines()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_lines()
        if self._bar is not None:
            self._bar.stop()
        else:
            self.log_now()

    @property
    def elapsed(self) -> float:
        """Generation seconds so far."""
        return self._clock() - self._start

    @property
    def output_rate(self) -> float:
        return self.output_tokens / max(self.elapsed, 1e-9)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens this run computed (not taken from the cache), of the finished samples."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def prompt_rate(self) -> float:
        return self.computed_tokens / max(self.elapsed, 1e-9)

    @property
    def prefill_eta_seconds(self) -> Optional[float]:
        """Seconds of prefill left at this run's computed-token rate; None without a plan's total or until
        enough has run to estimate."""
        if self.prefill_total_tokens is None:
            return None
        return eta_seconds(self.computed_tokens, self.prefill_total_tokens, self.elapsed)

    def _prefill_text(self) -> str:
        return "" if self.prefill_total_tokens is None else f"prefill eta {format_seconds(self.prefill_eta_seconds)}"

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
            self._bar.update(self._task, completed=self.done, rate=self.output_rate, prompt_rate=self.prompt_rate,
                             hit=self.hit_rate, prefill=self._prefill_text(), eta=self._eta_text())
        else:
            self.log_if_due()

    def _print_line(self, line: str) -> None:
        self._print(line)

    def _line(self) -> str:
        prefill = f"  {self._prefill_text()}" if self.prefill_total_tokens is not None else ""
        return (f"[{self.job_name}] {self.done}/{self.total} samples  {self.output_rate:.1f} tok/s  "
                f"prompt {self.prompt_rate:,.0f} tok/s  hit {self.hit_rate:.1%}{prefill}  "
                f"elapsed {format_seconds(self.elapsed)}  eta {self._eta_text()}")
