"""Prompt tokens/s (computed, not cached) and a prefill eta from the plan's computed prompt tokens, with
the samples' eta rules (5 s and 5% first); the planning and generation progress print their plain lines
through one `PlainLines`. All on a fake clock."""
from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from batchinfer.jobs.global_plan.progress import PlanningProgress
from batchinfer.jobs.run.progress import ProgressReporter, computed_tokens_to_do
from batchinfer.jobs.outdir.progress_time import PlainLines


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sample(prompt: int = 800, cached: int = 700):
    return SimpleNamespace(completion_tokens=8, prompt_tokens=prompt, cached_tokens=cached)


def _plain_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=300)


def test_prompt_tokens_per_second_counts_computed_not_cached_tokens():
    clock = Clock()
    console = _plain_console()
    with ProgressReporter(console, "rag", total_samples=100, resumed_samples=0, clock=clock) as progress:
        for _ in range(10):
            progress.advance(_sample())  # 100 computed tokens each
        clock.now += 10.0
        progress.advance(_sample(prompt=50, cached=0))
        assert progress.prompt_rate == pytest.approx(1050 / 10.0)
    last = console.file.getvalue().splitlines()[-1]
    assert "prompt 105 tok/s" in last and "prefill eta" not in last, last  # no plan given: no prefill eta


def test_prefill_eta_waits_for_5_seconds_and_5_percent_of_the_computed_tokens():
    clock = Clock()
    console = _plain_console()
    progress = ProgressReporter(console, "rag", total_samples=1000, resumed_samples=0, clock=clock)
    progress.set_prefill_total(100_000)
    with progress:
        clock.now += 2.0
        for _ in range(60):  # 6,000 computed tokens (6%) but only 2 s
            progress.advance(_sample())
        assert progress.prefill_eta_seconds is None
        clock.now += 3.0
        progress.advance(_sample(prompt=10, cached=10))  # 5 s, nothing computed
        assert progress.prefill_eta_seconds == pytest.approx(94_000 * 5.0 / 6_000)
        progress.log_now()
        assert "prefill eta 1m18s  elapsed 5s" in console.file.getvalue().splitlines()[-1]
        clock.now += 1.0
        for _ in range(3):  # 30 computed tokens: still under 5% of the plan
            progress.advance(_sample(prompt=20, cached=10))
    fresh = ProgressReporter(_plain_console(), "rag", total_samples=1000, resumed_samples=0, clock=clock,
                             prefill_total_tokens=100_000)
    with fresh:
        clock.now += 30.0
        for _ in range(40):  # 4,000 of 100,000: under 5%, however long it ran
            fresh.advance(_sample())
        assert fresh.prefill_eta_seconds is None
        assert fresh.eta_seconds is None


def test_prefill_done_reads_0s():
    clock = Clock()
    with ProgressReporter(_plain_console(), "rag", total_samples=10, resumed_samples=0, clock=clock,
                          prefill_total_tokens=500) as progress:
        clock.now += 6.0
        for _ in range(6):  # 600 computed: more than planned (a preempted row recomputes)
            progress.advance(_sample())
        assert progress.prefill_eta_seconds == 0.0


def test_the_plan_leaves_this_run_its_computed_tokens_less_the_resumed_share():
    summary = SimpleNamespace(prompt_tokens=10_000, unit_ideal_cached_tokens=8_000)
    assert computed_tokens_to_do(summary, total_samples=100, resumed_samples=0) == 2_000
    assert computed_tokens_to_do(summary, total_samples=100, resumed_samples=25) == 1_500
    assert computed_tokens_to_do(summary, total_samples=0, resumed_samples=0) == 0


def test_the_terminal_bar_shows_prompt_tokens_per_second_and_the_prefill_eta():
    clock = Clock()
    console = Console(file=io.StringIO(), force_terminal=True, width=300)
    progress = ProgressReporter(console, "rag", total_samples=100, resumed_samples=0, clock=clock,
                                prefill_total_tokens=1_000)
    with progress:
        clock.now += 10.0
        for _ in range(5):
            progress.advance(_sample())
        progress._bar.refresh()
    shown = console.file.getvalue()
    assert re.search(r"prompt +50 tok/s hit +87\.5% prefill eta 10s eta", shown), shown


def test_plain_lines_on_time_for_both_progress_kinds_on_a_fake_clock():
    """One implementation of the due-line rule: a line once `log_every_seconds` have passed, none before."""
    clock = Clock()
    console = _plain_console()
    generation = ProgressReporter(console, "rag", total_samples=10, resumed_samples=0, clock=clock,
                                  prefill_total_tokens=1_000, log_every_seconds=10.0)
    planning = PlanningProgress(console, "rag", clock=clock, log_every_seconds=10.0)
    assert isinstance(generation, PlainLines) and isinstance(planning, PlainLines)
    generation.start_lines = planning.start_lines = lambda: None  # no thread: this test is the heartbeat
    with planning:
        planning.phase("tokenise", 100)
        clock.now += 9.0
        planning.log_if_due()
        clock.now += 1.0
        planning.advance(40, tokens=400)
        planning.log_if_due()  # just printed: not due again
    with generation:
        clock.now += 9.9
        generation.log_if_due()
        clock.now += 0.1
        generation.log_if_due()
        lines = console.file.getvalue().splitlines()  # before the closing line
    assert [line for line in lines if "tokenise 40/100 rows  400 tokens" in line] == \
        ["[rag] plan: tokenise 40/100 rows  400 tokens  4 rows/s  elapsed 10s  eta 15s"], lines
    assert [line for line in lines if "0/10 samples  " in line] == \
        ["[rag] 0/10 samples  0.0 tok/s  prompt 0 tok/s  hit 0.0%  prefill eta ?  elapsed 10s  eta ?"], lines
