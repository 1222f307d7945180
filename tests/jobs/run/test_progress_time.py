"""Progress time: no eta until enough of the run has run (the first sample of a global plan can end
at half the job's time: "eta 23697s" for a job that had 110 s left), etas read as h/m/s, and without
a terminal a plain line every `log_every_seconds` even while no sample finishes."""
from __future__ import annotations

import io
import re
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from batchinfer.jobs.run.executors.tally import ProgressSnapshot
from batchinfer.jobs.global_plan.progress import PlanningProgress
from batchinfer.jobs.run.progress import ProgressReporter
from batchinfer.jobs.outdir.progress_time import format_seconds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sample():
    return SimpleNamespace(completion_tokens=8, prompt_tokens=800, cached_tokens=700)


def _plain_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=200)


def test_no_eta_from_a_first_sample_that_ends_late_then_one_in_hms():
    clock = Clock()
    console = _plain_console()
    progress = ProgressReporter(console, "qa", total_samples=194, resumed_samples=0, log_every_seconds=10.0,
                                clock=clock)
    with progress:
        clock.now += 123.0  # the first unit's prefill: no sample ends before
        progress.advance(_sample())
        assert progress.eta_seconds is None
        assert console.file.getvalue().splitlines()[-1].endswith("elapsed 2m03s  eta ?")
        for _ in range(29):  # a burst: 30 of 194 samples
            progress.advance(_sample())
        clock.now += 14.0
        progress.advance(_sample())
        assert progress.eta_seconds == pytest.approx(163 * 137 / 31)
    lines = console.file.getvalue().splitlines()
    assert re.search(r"31/194 samples .* elapsed 2m17s  eta 12m00s$", lines[-1]), lines[-1]


@pytest.mark.parametrize("seconds, text", [(None, "?"), (0.4, "0s"), (59.4, "59s"), (61, "1m01s"),
                                           (3599, "59m59s"), (26221, "7h17m"), (360000, "100h00m")])
def test_durations_read_as_hours_minutes_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_the_workers_eta_waits_for_enough_of_the_run_and_leaves_out_resumed_samples():
    def snap(done: int, skipped: int, elapsed: float) -> ProgressSnapshot:
        return ProgressSnapshot(samples_done=done, samples_total=1000, units_finished=0, units_total=10,
                                prompt_tokens=0, cached_tokens=0, output_tokens=0, elapsed_seconds=elapsed,
                                workers_busy=1, samples_skipped=skipped)

    assert snap(1, 0, 120.0).eta_seconds is None
    assert snap(520, 500, 120.0).eta_seconds is None  # 20 of this run's 500: too few to estimate
    assert snap(550, 500, 100.0).eta_seconds == pytest.approx(450 * 100.0 / 50)


def test_without_a_terminal_a_line_comes_on_time_while_no_sample_finishes():
    console = _plain_console()
    with ProgressReporter(console, "qa", total_samples=10, resumed_samples=0, log_every_seconds=0.05):
        time.sleep(0.6)  # one long prefill: nothing finishes
        lines = console.file.getvalue().splitlines()
    assert len([line for line in lines if "0/10 samples" in line and "eta ?" in line]) >= 3, lines


def test_without_a_terminal_planning_prints_on_time_during_a_slow_batch():
    console = _plain_console()
    with PlanningProgress(console, "qa", log_every_seconds=0.05) as progress:
        progress.phase("tokenise", 1000)
        time.sleep(0.6)  # one slow batch of rows
        progress.advance(1000)
    lines = console.file.getvalue().splitlines()
    assert len([line for line in lines if "tokenise 0/1,000 rows" in line]) >= 3, lines
    assert lines[-1].startswith("[qa] plan: tokenise done: 1,000 rows")
