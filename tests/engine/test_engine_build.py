"""The engine builds in a background thread while the job plans (engine/engine_build.py), the
weights read before it waits for the plan's row figure, which sizes max_running; a build that
fails is the run's failure, as before, and leaves the output folder as it was."""
from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
from rich.console import Console

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine_build import EngineBuild, awaited_row_tokens, build_engine, expected_row_tokens
from batchinfer.jobs.errors import JobRuntimeError
from batchinfer.jobs.run import runner
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
from tests.job_process import demo_cache  # noqa: F401 (fixture)
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

ROWS = 13


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _job(folder: Path, checkpoint: Path):
    write_parquet(rag_table(ROWS), folder / "data" / "rag.parquet")
    job_file = write_job_file(folder, [job_entry(model=str(checkpoint), sampling={"max_tokens": 7})])
    return prepare_job(load_job_file(job_file).jobs[0])


def _planning_seen(monkeypatch) -> threading.Event:
    started = threading.Event()
    plan_units = runner.plan_units

    def planning(*args, **kwargs):
        started.set()
        return plan_units(*args, **kwargs)

    monkeypatch.setattr(runner, "plan_units", planning)
    return started


def test_the_engine_builds_while_the_job_plans_and_gets_the_plans_row_figure(tmp_path, checkpoint, monkeypatch):
    planning = _planning_seen(monkeypatch)
    seen = {}

    def factory(job, window_rows):  # the build: still running when the planning starts
        seen["overlapped"] = planning.wait(timeout=20)
        seen["row_tokens"] = awaited_row_tokens()
        return FakeEngine()

    stats = runner.run_job(_job(tmp_path, checkpoint), Console(quiet=True), engine_factory=factory)
    assert stats["status"] == "done" and seen["overlapped"]
    plan, samples = stats["plan"], ROWS
    assert seen["row_tokens"] == math.ceil(
        (plan["prompt_tokens"] - plan["global_ideal_cached_tokens"] + samples * 7) / samples)


def test_a_build_that_fails_is_the_runs_failure_and_leaves_no_plan_behind(tmp_path, checkpoint, monkeypatch):
    planning = _planning_seen(monkeypatch)

    def factory(job, window_rows):
        planning.wait(timeout=20)
        raise RuntimeError("no such device")

    with pytest.raises(JobRuntimeError, match="cannot load the model: RuntimeError: no such device"):
        runner.run_job(_job(tmp_path, checkpoint), Console(quiet=True), engine_factory=factory)
    assert planning.is_set() and not (tmp_path / "out").exists()


def test_build_engine_reads_the_weights_before_it_waits_for_the_figure(demo_cache, monkeypatch):
    from batchinfer.demo import demo_checkpoint
    from batchinfer.models import loader

    loaded = threading.Event()
    load_weights = loader.load_weights
    monkeypatch.setattr(loader, "load_weights", lambda *a, **k: (load_weights(*a, **k), loaded.set()))
    config = EngineConfig(device="cpu", dtype="fp32", memory_budget_bytes=512 << 20)
    build = EngineBuild.start(lambda: build_engine(str(demo_checkpoint()), config))
    assert loaded.wait(timeout=60)  # the weights are in before the plan says anything
    build.post_row_tokens(1500)
    engine = build.result()
    assert engine.config.row_tokens == 1500
    assert engine.pool_plan.max_running < build_engine(str(demo_checkpoint()), config).pool_plan.max_running
    assert engine.startup_seconds["load"] > 0


def test_a_hand_set_max_running_does_not_wait_and_no_figure_means_the_defaults(demo_cache):
    from batchinfer.demo import demo_checkpoint

    config = EngineConfig(device="cpu", dtype="fp32", memory_budget_bytes=64 << 20, max_running=5)
    build = EngineBuild.start(lambda: build_engine(str(demo_checkpoint()), config))
    assert build.result().pool_plan.max_running == 5  # nothing posted, nothing waited for
    build = EngineBuild.start(lambda: build_engine(str(demo_checkpoint()), EngineConfig(device="cpu", dtype="fp32")))
    assert build.result().config.row_tokens is None
    assert expected_row_tokens(1000, 400, 300, 0) is None and expected_row_tokens(1000, 400, 300, 9) == 100


def test_the_builds_exception_is_raised_in_the_caller():
    build = EngineBuild.start(lambda: (_ for _ in ()).throw(KeyError("weights")))
    with pytest.raises(KeyError, match="weights"):
        build.result()


@pytest.mark.slow
def test_a_cli_run_sizes_its_engine_by_the_plan(tmp_path, demo_cache):
    """Through `python -m batchinfer run`: the engine built beside the plan gets the plan's row
    figure (in `_stats.json`), and the job completes with every row."""
    import json

    from tests.job_process import start_run, write_demo_job

    out = write_demo_job(tmp_path, 12, engine={"device": "cpu"}, sampling={"max_tokens": 5, "ignore_eos": True})
    process = start_run(tmp_path, demo_cache)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-2000:]
    stats = json.loads((out / "_stats.json").read_text())
    plan, settings = stats["plan"], stats["engine_settings"]
    assert stats["status"] == "done" and stats["rows"] == 12
    assert settings["row_tokens"] == math.ceil((plan["prompt_tokens"] - plan["global_ideal_cached_tokens"] + 12 * 5) / 12)
    assert stats["startup_seconds"]["plan"] > 0 and stats["startup_seconds"]["load"] > 0
