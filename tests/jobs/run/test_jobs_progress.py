"""Startup phases in the progress display, an eta only once generation has a rate, rates over the
generation time, and the startup / generation split in _stats.json."""
from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from batchinfer.engine.startup import listening, phase
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.progress import ETA_AFTER_SECONDS, ProgressReporter
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sample(tokens: int = 10):
    return SimpleNamespace(completion_tokens=tokens, prompt_tokens=20, cached_tokens=5)


def _plain_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=200)


def test_no_eta_from_the_first_sample_and_rates_over_generation_only():
    clock = Clock()
    progress = ProgressReporter(_plain_console(), "rag", total_samples=1000, resumed_samples=0, clock=clock)
    clock.now += 60.0  # startup: loading, compiling, planning
    with progress:
        clock.now += 0.5
        progress.advance(_sample())
        assert progress.eta_seconds is None  # one sample after half a second says nothing
        clock.now += ETA_AFTER_SECONDS
        for _ in range(49):  # 50 samples: 5% of the run (progress_time.ETA_AFTER_FRACTION)
            progress.advance(_sample())
        elapsed = 0.5 + ETA_AFTER_SECONDS
        assert progress.eta_seconds == pytest.approx(950 * elapsed / 50)
        assert progress.output_rate == pytest.approx(500 / elapsed)  # the 60 s of startup are not in it


def test_no_eta_before_a_sample_finishes():
    clock = Clock()
    progress = ProgressReporter(_plain_console(), "rag", total_samples=10, resumed_samples=0, clock=clock)
    with progress:
        clock.now += 100.0
        assert progress.eta_seconds is None


def test_a_finished_run_reads_eta_0s_even_before_an_estimate_is_due():
    """The demo's 48 samples end within 3 s: its last line read 'prefill eta ?  eta ?' at 48/48."""
    clock = Clock()
    console = _plain_console()
    with ProgressReporter(console, "rag", total_samples=4, resumed_samples=0, clock=clock,
                          prefill_total_tokens=60) as progress:
        clock.now += 1.0
        for _ in range(3):
            progress.advance(_sample())
        assert progress.eta_seconds is None and progress.prefill_eta_seconds is None  # 1 s: too soon
        progress.advance(_sample())  # 4 of 4 samples, 60 of 60 computed prompt tokens
        assert progress.eta_seconds == 0.0 and progress.prefill_eta_seconds == 0.0
    last = console.file.getvalue().splitlines()[-1]
    assert "eta ?" not in last and last.endswith("eta 0s"), last


def test_terminal_bar_shows_no_eta_after_the_first_sample():
    clock = Clock()
    console = Console(file=io.StringIO(), force_terminal=True, width=150)
    progress = ProgressReporter(console, "rag", total_samples=1000, resumed_samples=0, clock=clock)
    with progress:
        clock.now += 0.2
        progress.advance(_sample())
    shown = console.file.getvalue()
    assert "eta ?" in shown and "eta 0:" not in shown


def test_startup_phases_are_shown_with_their_seconds():
    console = _plain_console()
    progress = ProgressReporter(console, "rag", total_samples=4, resumed_samples=0)
    clock = Clock()
    seconds: dict[str, float] = {}

    def tick() -> float:
        clock.now += 1.5
        return clock.now

    with listening(progress.phase_listener):
        with phase("loading weights", seconds, "load", clock=tick):
            pass
        with phase("compiling kernels", seconds, "compile_and_capture", clock=tick):
            pass
    with phase("planning", seconds, "plan", clock=tick):  # nobody listening: timed only
        pass
    lines = console.file.getvalue().splitlines()
    assert lines == ["[rag] loading weights…", "[rag] loading weights: 1.5 s",
                     "[rag] compiling kernels…", "[rag] compiling kernels: 1.5 s"]
    assert seconds == {"load": 1.5, "compile_and_capture": 1.5, "plan": 1.5}


def test_engine_announces_and_times_loading(tmp_path):
    from batchinfer.engine import Engine, EngineConfig

    heard = []
    with listening(lambda label, seconds: heard.append((label, seconds is None))):
        engine = Engine.from_pretrained("tiny", EngineConfig(device="cpu", max_running=4,
                                                             memory_budget_bytes=16 << 20))
    assert heard == [("loading weights", True), ("loading weights", False)]  # CPU: no compile, no graphs
    assert engine.startup_seconds["load"] > 0 and engine.startup_seconds["compile_and_capture"] == 0.0


def test_stats_split_startup_from_generation(tmp_path):
    checkpoint = make_tokenizer_checkpoint(tmp_path / "ckpt")
    write_parquet(rag_table(8), tmp_path / "data" / "rag.parquet", row_group_size=4)
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), sampling={"max_tokens": 4})])
    engine = FakeEngine()
    engine.startup_seconds = {"load": 2.0, "compile_and_capture": 3.0}
    console = _plain_console()
    job = prepare_job(load_job_file(job_file).jobs[0], overwrite=False)
    run_job(job, console, engine_factory=lambda _job, _rows: engine)
    stats = json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())
    startup = stats["startup_seconds"]
    assert set(startup) == {"load", "compile_and_capture", "plan"}
    assert startup["load"] == 2.0 and startup["compile_and_capture"] == 3.0 and startup["plan"] > 0
    assert 0 < stats["generation_seconds"] <= stats["wall_seconds"]
    assert stats["output_tokens_per_second"] == pytest.approx(stats["output_tokens"] / stats["generation_seconds"])
    assert "[rag] planning…" in console.file.getvalue()
