"""A real job on several CPU engine processes (the demo model, fp32): the same outputs as one engine.

`workers: 2` spawns two worker processes, each loading the demo model once and committing its
units' parts itself; the parent holds the folder's lock and shows one progress. The runs here
cut the job into three units of two documents each (cuts between documents lose nothing), so
the cached tokens of every run must be the global ideal.
"""
from __future__ import annotations

import json
import random
import signal
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.global_plan import UnitConfig
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.job_process import demo_cache, run_in_this_process, start_run, wait_for  # noqa: F401 (fixture)
from tests.jobs_fixtures import job_entry, write_job_file, write_parquet
from tests.worker_faults import fault_executor

pytestmark = pytest.mark.slow  # worker processes, kills and signals

TEMPLATE = "{document}\n\nQuestion: {question}\nAnswer:"
WORDS = "river town baker shutters bread morning market lantern harbor bridge stone garden".split()
DOCS, QUESTIONS = 6, 4
UNITS = UnitConfig(max_rows=8, units_goal=1)   # three units of two documents
GREEDY = {"max_tokens": 3, "ignore_eos": True}
SEEDED = {"max_tokens": 3, "ignore_eos": True, "temperature": 0.9, "top_k": 20, "n": 2, "seed": 11}


def rag_rows() -> pa.Table:
    rng = random.Random(3)
    # Each document starts with its own letter: no prefix is shared across documents.
    documents = ["ABCDEFGH"[i] + "x " + " ".join(rng.choice(WORDS) for _ in range(16)) for i in range(DOCS)]
    rows = [(documents[d], f"What about the {WORDS[q]} {q}?") for d in range(DOCS) for q in range(QUESTIONS)]
    random.Random(5).shuffle(rows)
    return pa.table({"document": [r[0] for r in rows], "question": [r[1] for r in rows]})


@pytest.fixture(autouse=True)
def uses_the_demo_cache(demo_cache) -> Path:  # noqa: F811 - the jobs below name model: demo
    return demo_cache


@pytest.fixture(scope="module")
def one_engine(tmp_path_factory):
    """The in-process run (one engine) of each sampling, made once for the module: (stats, outputs)."""
    runs: dict[str, tuple[dict, pa.Table]] = {}

    def get(sampling: dict) -> tuple[dict, pa.Table]:
        key = json.dumps(sampling, sort_keys=True)
        if key not in runs:
            with pytest.MonkeyPatch.context() as env:  # the demo_cache fixture's folder, for this module scope
                env.setenv("BATCHINFER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "demo-cache"))
                runs[key] = run(tmp_path_factory.mktemp("one-engine"), sampling)
        return runs[key]
    return get


def write_job(folder: Path, sampling: dict, flush_rows: int = 2, **parallel) -> Path:
    write_parquet(rag_rows(), folder / "data" / "rag.parquet")
    return write_job_file(folder, [job_entry(
        model="demo", prompt={"template": TEMPLATE}, sampling=sampling,
        engine={"device": "cpu", "dtype": "float32", "max_running": 4, "track_interval": 16},
        output={"path": "out/rag", "flush_rows": flush_rows}, **({"parallel": parallel} if parallel else {}))])


def run(folder: Path, sampling: dict, unit_executor=None, **parallel) -> tuple[dict, pa.Table]:
    job_file = write_job(folder, sampling, **parallel)
    job = prepare_job(load_job_file(job_file).jobs[0])
    stats = run_job(job, Console(quiet=True), unit_config=UNITS, executor=unit_executor)
    return stats, pq.read_table(folder / "out" / "rag")


def generations(out: pa.Table) -> dict[tuple[int, int], tuple[int, ...]]:
    pairs = list(zip(out["row_index"].to_pylist(), out["sample_index"].to_pylist()))
    assert len(pairs) == len(set(pairs))  # every (row, sample) at most once
    return dict(zip(pairs, map(tuple, out["output_token_ids"].to_pylist())))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_two_cpu_workers_write_what_one_engine_writes_and_reach_the_global_ideal(tmp_path, one_engine, sampling):
    one_stats, one = one_engine(sampling)
    two_stats, two = run(tmp_path / "two", sampling, workers=2)
    assert "executor" not in one_stats                  # one engine: the in-process path
    executor = two_stats["executor"]
    assert executor["executor"] == "local" and executor["workers"] == 2 and executor["status"] == "done"
    assert [w["device"] for w in executor["per_worker"]] == ["cpu", "cpu"]
    assert sum(w["units"] for w in executor["per_worker"]) == two_stats["plan"]["units"] == 3
    assert len(generations(two)) == DOCS * QUESTIONS * sampling.get("n", 1)
    assert generations(two) == generations(one)
    ideal = two_stats["plan"]["global_ideal_cached_tokens"]
    assert ideal > 0 and two_stats["plan"]["recomputed_root_tokens"] == 0
    assert two_stats["cached_tokens"] == one_stats["cached_tokens"] == ideal
    assert two_stats["samples_written"] == len(generations(two)) and two_stats["status"] == "done"
    on_disk = json.loads((tmp_path / "two" / "out" / "rag" / "_stats.json").read_text())
    assert on_disk["executor"]["per_worker"] == executor["per_worker"]  # one _stats.json, per-worker section


def test_two_cpu_workers_run_the_units_of_a_window_plan(tmp_path, one_engine):
    _, one = one_engine(GREEDY)
    job = prepare_job(load_job_file(write_job(tmp_path, GREEDY, workers=2)).jobs[0])
    stats = run_job(job, Console(quiet=True), plan="window", window_rows=10)
    two = pq.read_table(tmp_path / "out" / "rag")
    assert (stats["plan"]["mode"], stats["plan"]["units"]) == ("window", 3)  # rows 0-9, 10-19, 20-23
    assert stats["executor"]["workers"] == 2 and sum(w["units"] for w in stats["executor"]["per_worker"]) == 3
    assert stats["status"] == "done" and stats["samples_written"] == DOCS * QUESTIONS
    assert generations(two) == generations(one)  # greedy: the same tokens, whichever units ran them


def test_a_worker_killed_mid_job_is_replaced_and_every_sample_is_written_once(tmp_path, one_engine):
    _, one = one_engine(GREEDY)
    # The first worker to finish its 3rd sample SIGKILLs itself: flush_rows 2 has committed its first
    # part of that unit by then, the rest of the unit is lost with it and runs again elsewhere.
    stats, two = run(tmp_path / "two", GREEDY, fault_executor("kill_self", 3, tmp_path / "killed"), workers=2)
    assert (tmp_path / "killed").exists()
    executor = stats["executor"]
    failures = [f for w in executor["per_worker"] for f in w["failures"]]
    assert len(failures) == 1 and "was killed by SIGKILL while running unit" in failures[0]
    assert sum(w["restarts"] for w in executor["per_worker"]) == 1 and executor["units_retried"]
    assert generations(two) == generations(one)               # all of them, each once
    assert stats["samples_written"] == DOCS * QUESTIONS
    retried = executor["units_retried"][0]
    parts = Counter(name.split("-")[1] for name in (p.name for p in (tmp_path / "two" / "out" / "rag").iterdir())
                    if name.startswith("part-u"))
    assert parts[f"u{retried:06d}"] >= 2                      # the killed unit's parts: kept and completed


def test_run_workers_overrides_the_job_file(tmp_path):
    write_job(tmp_path, GREEDY)  # no parallel block: one engine
    result = run_in_this_process(tmp_path, "--workers", "2")
    assert result.exit_code == 0, (result.output, result.exception)
    stats = json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())
    assert stats["executor"]["workers"] == 2 and stats["samples_written"] == DOCS * QUESTIONS


def test_sigterm_of_the_parent_stops_the_workers_exits_143_and_a_rerun_completes_each_sample_once(
        tmp_path, demo_cache):  # noqa: F811
    write_job(tmp_path, {"max_tokens": 40, "ignore_eos": True}, workers=2)
    out_dir = tmp_path / "out" / "rag"
    first = start_run(tmp_path, demo_cache)
    wait_for(lambda: any(out_dir.glob("part-u*.parquet")), first)  # a worker has committed a part
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr
    assert stderr.splitlines()[-1] == "error: job rag: terminated by SIGTERM (finished parts are kept; rerun to resume)"
    stats = json.loads((out_dir / "_stats.json").read_text())
    assert stats["status"] == "interrupted" and stats["interrupted_by"] == "SIGTERM"
    assert stats["executor"]["status"] == "interrupted"
    kept = set(generations(pq.read_table(out_dir)))
    assert 0 < len(kept) < DOCS * QUESTIONS
    result = run_in_this_process(tmp_path)
    assert result.exit_code == 0, (result.output, result.exception)
    done = generations(pq.read_table(out_dir))     # asserts each (row, sample) at most once
    assert set(done) == {(row, 0) for row in range(DOCS * QUESTIONS)} and kept <= set(done)


def test_a_stopped_run_commits_what_its_workers_finished_in_open_chunks(tmp_path):
    # One chunk per unit (flush_rows 1000): without the workers' last commit, a run stopped before
    # any unit completes would keep nothing. The first worker to finish 3 samples SIGTERMs this process.
    job_file = write_job(tmp_path, {"max_tokens": 40, "ignore_eos": True}, flush_rows=1000, workers=2)

    class Stopped(BaseException):
        pass

    def stopped(signum, frame):
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, stopped)  # as the CLI's handler: the run re-delivers SIGTERM to it
    try:
        with pytest.raises(Stopped):
            run_job(prepare_job(load_job_file(job_file).jobs[0]), Console(quiet=True), unit_config=UNITS,
                    executor=fault_executor("stop_parent", 3, tmp_path / "stopped"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    out_dir = tmp_path / "out" / "rag"
    stats = json.loads((out_dir / "_stats.json").read_text())
    assert stats["status"] == "interrupted" and stats["executor"]["units_finished"] == 0
    kept = set(generations(pq.read_table(out_dir))) if any(out_dir.glob("part-*.parquet")) else set()
    assert len(kept) >= 3 and stats["samples_written"] == len(kept)
    result = run_in_this_process(tmp_path)
    assert result.exit_code == 0, (result.output, result.exception)
    assert set(generations(pq.read_table(out_dir))) == {(row, 0) for row in range(DOCS * QUESTIONS)}


def test_a_worker_engine_is_sized_by_the_plans_row_figure(tmp_path, monkeypatch):
    """Each worker builds its engine with the plan's row figure (`EngineConfig.row_tokens`), as the
    in-process engine gets it posted: MoE and long-row jobs size their rows from it."""
    from batchinfer.jobs.global_plan import open_work_plan, work_dir_for
    from batchinfer.jobs.run import runner
    from batchinfer.jobs.run.global_run import plan_row_tokens
    from batchinfer.jobs.run.unit_worker import JobUnitWorker, job_recipe

    job_file = write_job(tmp_path, GREEDY)
    text = job_file.read_text().replace("flush_rows: 2", "flush_rows: 2\n    keep_work: true")
    job_file.write_text(text)
    spec = load_job_file(job_file).jobs[0]
    assert spec.output.keep_work
    run_job(prepare_job(spec), Console(quiet=True), unit_config=UNITS)
    expected = plan_row_tokens(open_work_plan(work_dir_for(spec.output.path)).summary)
    assert expected is not None and expected > 0

    asked: dict = {}

    def fake_open_engine(job, window_rows=runner.WINDOW_ROWS, row_tokens=None):
        asked["row_tokens"] = row_tokens
        return object()

    monkeypatch.setattr(runner, "open_engine", fake_open_engine)
    JobUnitWorker(job_recipe(spec)).open(0, "cpu", lambda *_: None)
    assert asked["row_tokens"] == expected
