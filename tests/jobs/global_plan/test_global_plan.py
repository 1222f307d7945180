"""The global plan of a job: identities over shuffled input, work folder reuse, kill -9, workers, `batchinfer plan`."""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

import batchinfer.jobs.global_plan.sorted_rows as sorted_rows_module
import batchinfer.jobs.global_plan.spill as spill_module
from batchinfer.engine.planner import make_plan
from batchinfer.jobs.global_plan import (PlanNotFound, PlanningProgress, SortBudget, UnitConfig, build_work_plan,
                              open_matching_plan, open_work_plan, remove_work_dir, work_dir_for)
from batchinfer.jobs.run.planning import plan_job, plan_job_globally
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.inputs.prompts import build_prompts
from batchinfer.jobs.spec.job_file import load_job_file
from tests.cli_utils import invoke_cli
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, write_job_file, write_parquet

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY = SortBudget(run_bytes=4000, merge_bytes=4000, fan_in=3)  # many runs, several merge passes
SMALL_UNITS = UnitConfig(max_rows=40, target_cost=1e12)  # units of 40 rows
WORDS = "the river town woke early and baker opened shutters state gate books weeks library".split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def rag_rows(documents: int, questions: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 30))) for _ in range(documents)]
    return [{"document": doc, "question": f"question {q} about {rng.choice(WORDS)}?"}
            for doc in docs for q in range(questions)]


def make_job(folder: Path, checkpoint: Path, rows: list[dict], **overrides) -> Path:
    table = pa.table({"document": [r["document"] for r in rows], "question": [r["question"] for r in rows]})
    write_parquet(table, folder / "data" / "rag.parquet", row_group_size=97)
    entry = job_entry(model=str(checkpoint), sampling={"max_tokens": 8, "n": 2})
    entry.update(overrides)
    return write_job_file(folder, [entry])


def prepared(job_file: Path):
    return prepare_job(load_job_file(job_file).jobs[0], overwrite=True)


def job_prompts(job) -> list:
    table = pq.read_table(job.inputs.paths[0])
    return build_prompts(table, job.spec.prompt, job.tokenizer, job.spec.chat, job.spec.system,
                         job.vocab_size).token_ids


def build(job, folder: Path, config: UnitConfig = SMALL_UNITS):
    return build_work_plan(job, folder, config, budget=TINY, window_rows=50)


def test_shuffled_and_grouped_copies_plan_the_same_units_whose_ideals_sum_to_the_global_ideal(tmp_path, checkpoint):
    grouped = rag_rows(60, 6)
    grouped[7]["document"] = None  # a row without a prompt
    shuffled = list(grouped)
    random.Random(3).shuffle(shuffled)
    plans = {}
    for name, rows in (("grouped", grouped), ("shuffled", shuffled)):
        job = prepared(make_job(tmp_path / name, checkpoint, rows))
        plans[name] = (job, build(job, tmp_path / name / "work"))
    (job, plan), (_, other) = plans["shuffled"], plans["grouped"]
    assert plan.summary == other.summary
    assert [u.to_dict() for u in plan.units] == [u.to_dict() for u in other.units]
    prompts = job_prompts(job)
    everything = make_plan([p for p in prompts if p is not None], 2).summary
    assert plan.summary.ideal_cached_tokens == everything.theoretical_max_cached_tokens
    assert plan.summary.unit_ideal_cached_tokens == plan.summary.ideal_cached_tokens \
        - plan.summary.recomputed_root_tokens
    assert len(plan.units) > 5  # more rows than any internal window, run or unit
    seen = []
    for unit in plan.units:
        rows = plan.read_unit(unit.unit_id)
        seen += [row.row_index for row in rows]
        for row in rows:
            assert row.token_ids == prompts[row.row_index]
            assert (row.error is None) == (prompts[row.row_index] is not None)
        unit_plan = make_plan([row.token_ids for row in rows if row.token_ids is not None], 2).summary
        assert unit.ideal_cached_tokens == unit_plan.theoretical_max_cached_tokens
    assert sorted(seen) == list(range(len(shuffled)))  # every row exactly once
    errors = [row for u in plan.units for row in plan.read_unit(u.unit_id) if row.error is not None]
    assert [(r.token_ids, r.error) for r in errors] == [(None, "template column 'document' is null")]
    costs = [u.cost for u in plan.iter_units_by_cost()]
    assert costs == sorted(costs, reverse=True)


def test_units_read_the_same_rows_whatever_the_row_groups_of_the_sorted_file(tmp_path, checkpoint, monkeypatch):
    job = prepared(make_job(tmp_path, checkpoint, rag_rows(20, 4)))
    plan = build(job, tmp_path / "a")
    monkeypatch.setattr(sorted_rows_module, "ROW_GROUP_ROWS", 4)
    monkeypatch.setattr(sorted_rows_module, "MAX_ROW_GROUPS", 3)
    regrouped = build(job, tmp_path / "b")
    assert pq.ParquetFile(tmp_path / "b" / "sorted.parquet").num_row_groups == 3  # 80 rows: 27 a group
    assert regrouped.units == plan.units
    assert [regrouped.read_unit(u.unit_id) for u in plan.units] == [plan.read_unit(u.unit_id) for u in plan.units]


def test_a_rerun_reuses_the_spill_and_recuts_units_when_only_the_unit_config_or_sampling_changed(
        tmp_path, checkpoint, monkeypatch):
    job_file = make_job(tmp_path, checkpoint, rag_rows(20, 4))
    first = build(prepared(job_file), tmp_path / "work")
    assert not first.reused_spill
    sorted_hash = hashlib.sha256((tmp_path / "work" / "sorted.parquet").read_bytes()).hexdigest()

    def no_tokenising(*args, **kwargs):
        raise AssertionError("the spill should have been reused")
    monkeypatch.setattr(spill_module, "build_prompts", no_tokenising)
    again = build(prepared(job_file), tmp_path / "work")
    assert again.reused_spill and again.units == first.units and again.summary == first.summary
    recut = build(prepared(job_file), tmp_path / "work", UnitConfig(max_rows=7, target_cost=1e12))
    assert recut.reused_spill and len(recut.units) > len(first.units)
    assert len(list((tmp_path / "work").glob("units-*.parquet"))) == 1  # the old units file is gone
    more_samples = build(prepare_job(load_job_file(make_job(tmp_path, checkpoint, rag_rows(20, 4),
                                                            sampling={"n": 3, "max_tokens": 8})).jobs[0],
                                     overwrite=True), tmp_path / "work")
    assert more_samples.reused_spill and more_samples.summary.samples == 3 * first.summary.samples // 2
    assert hashlib.sha256((tmp_path / "work" / "sorted.parquet").read_bytes()).hexdigest() == sorted_hash


def test_a_units_file_written_before_a_kill_is_not_read_with_the_older_commit_record(tmp_path, checkpoint):
    job = prepared(make_job(tmp_path, checkpoint, rag_rows(20, 4)))
    work = tmp_path / "work"
    older = build(job, work)
    record, (units_file,) = (work / "plan.json").read_bytes(), list(work.glob("units-*"))
    kept = units_file.read_bytes()
    newer = build(job, work, UnitConfig(max_rows=7, target_cost=1e12))
    # As if killed after writing the newer units file, before committing its record: the older one
    # still names its own units file, beside the newer file and a build's leftovers.
    (work / "plan.json").write_bytes(record)
    units_file.write_bytes(kept)
    (work / ".build").mkdir()
    (work / ".units-0123456789abcdef.parquet.tmp").write_text("half")
    again = build(job, work, UnitConfig(max_rows=7, target_cost=1e12))
    assert again.reused_spill and again.summary == newer.summary and again.units == newer.units
    assert older.summary != newer.summary
    assert not (work / ".build").exists() and not list(work.glob(".*.tmp"))


@pytest.mark.parametrize("change", ["input", "template", "limit", "model"])
def test_a_changed_input_prompt_or_model_rebuilds_the_spill(tmp_path, checkpoint, change):
    rows = rag_rows(20, 4)
    job_file = make_job(tmp_path, checkpoint, rows)
    first = build(prepared(job_file), tmp_path / "work")
    overrides = {}
    if change == "input":
        rows[3]["question"] = "a different question?"
    elif change == "template":
        overrides = {"prompt": {"template": "{question}\n{document}"}}
    elif change == "limit":
        overrides = {"limit": 50}
    else:
        other = make_tokenizer_checkpoint(tmp_path / "ckpt2")
        (other / "config.json").write_text(json.dumps({**json.loads((other / "config.json").read_text()),
                                                       "rms_norm_eps": 1e-5}))
        overrides = {"model": str(other)}
    job = prepared(make_job(tmp_path, checkpoint, rows, **overrides))
    second = build(job, tmp_path / "work")
    assert not second.reused_spill
    prompts = [p for p in job_prompts(job)[:job.rows] if p is not None]
    assert second.summary.ideal_cached_tokens == make_plan(prompts, 2).summary.theoretical_max_cached_tokens
    if change in ("input", "template", "limit"):
        assert second.summary != first.summary


@pytest.mark.slow
def test_workers_read_units_from_another_process(tmp_path, checkpoint):
    job = prepared(make_job(tmp_path, checkpoint, rag_rows(20, 4)))
    plan = build(job, tmp_path / "work")
    script = ("import json, sys; from batchinfer.jobs.global_plan import open_work_plan; "
              "plan = open_work_plan(sys.argv[1]); "
              "print(json.dumps([[r.row_index, r.token_ids, r.error] for u in plan.units "
              "for r in plan.read_unit(u.unit_id)]))")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "work")], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == [[r.row_index, r.token_ids, r.error] for u in plan.units
                               for r in plan.read_unit(u.unit_id)]
    remove_work_dir(tmp_path / "work")
    assert not (tmp_path / "work").exists()
    with pytest.raises(PlanNotFound):
        open_work_plan(tmp_path / "work")


KILLED_BUILD = """
import sys
from pathlib import Path
from batchinfer.jobs.global_plan import SortBudget, UnitConfig, build_work_plan
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.spec.job_file import load_job_file
job = prepare_job(load_job_file(Path(sys.argv[1])).jobs[0], overwrite=True)
build_work_plan(job, Path(sys.argv[2]), UnitConfig(max_rows=40, min_rows=1),
                budget=SortBudget(run_bytes=2000, merge_bytes=2000, fan_in=2), window_rows=20)
"""


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["tokenise", "sort"])
def test_kill_9_mid_plan_leaves_no_plan_a_rerun_trusts_and_the_rerun_is_right(tmp_path, checkpoint, phase):
    rows = rag_rows(60, 10)
    random.Random(4).shuffle(rows)
    job_file = make_job(tmp_path, checkpoint, rows)
    work = tmp_path / "out" / "_work"
    # A committed plan of other rows first: a kill during the rebuild must not leave it trusted either.
    make_job(tmp_path, checkpoint, rows[:100])
    build(prepared(tmp_path / "jobs.yaml"), work)
    make_job(tmp_path, checkpoint, rows)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(job_file), str(work)], env=env,
                               stderr=subprocess.PIPE)
    marker = (lambda: len(list((work / ".build" / "runs").glob("run-*"))) >= 3) if phase == "tokenise" else \
        (lambda: bool(list(work.glob(".sorted.parquet.*tmp"))) and not list((work / ".build" / "runs").glob("run-*")))
    deadline = time.monotonic() + 120
    while not marker() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert process.poll() is None, process.stderr.read().decode()  # still planning: the kill lands mid-plan
    process.send_signal(signal.SIGKILL)
    process.wait()
    with pytest.raises(PlanNotFound):
        open_work_plan(work)
    job = prepared(job_file)
    assert open_matching_plan(job, work) is None
    rerun = build(job, work)
    fresh = build(job, tmp_path / "fresh")
    assert not rerun.reused_spill and rerun.summary == fresh.summary and rerun.units == fresh.units
    assert [rerun.read_unit(u.unit_id) for u in rerun.units] == [fresh.read_unit(u.unit_id) for u in fresh.units]
    assert sorted(p.name for p in work.iterdir()) == ["plan.json", "sorted.parquet",
                                                      next(work.glob("units-*")).name]


def tree_hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_batchinfer_plan_reports_the_global_plan_writes_nothing_and_reuses_a_committed_work_folder(
        tmp_path, checkpoint):
    rows = rag_rows(30, 5)
    random.Random(5).shuffle(rows)
    make_job(tmp_path, checkpoint, rows)
    result = invoke_cli(tmp_path, "plan", "jobs.yaml", "--workers", "3", "--per-window", "--unit-rows", "16")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "out").exists()  # planning writes nothing into the output folder
    job = prepared(tmp_path / "jobs.yaml")
    report = plan_job_globally(job, workers=3, per_window=True, config=UnitConfig(max_rows=16, min_rows=16))
    assert f"{report.summary.ideal_cached_tokens:,}" in result.output
    assert f"{plan_job(job).theoretical_max_cached_tokens:,}" in result.output
    assert f"work units" in result.output and f"{report.summary.units:,}" in result.output
    assert "predicted balance over 3 workers" in result.output and f"{report.balance.makespan:,.0f}" in result.output
    assert report.balance.unit_counts and sum(report.balance.unit_counts) == report.summary.units
    assert not report.reused_work_dir
    # A committed _work/ from the same input, prompt and model is reused, read-only.
    work = work_dir_for(job.spec.output.path)
    build(job, work)
    before = tree_hashes(tmp_path / "out")
    again = invoke_cli(tmp_path, "plan", "jobs.yaml", "--unit-rows", "16")
    assert again.exit_code == 0, again.output
    assert "reused _work/" in again.output and f"{report.summary.ideal_cached_tokens:,}" in again.output
    assert tree_hashes(tmp_path / "out") == before
    assert invoke_cli(tmp_path, "plan", "jobs.yaml", "--workers", "0").exit_code == 2


def test_planning_progress_plain_lines_and_terminal_bar(tmp_path, checkpoint):
    job = prepared(make_job(tmp_path, checkpoint, rag_rows(30, 5)))
    plain = Console(file=io.StringIO(), force_terminal=False, width=200)
    with PlanningProgress(plain, "rag", log_every_seconds=0.0) as progress:
        build_work_plan(job, tmp_path / "a", progress=progress, window_rows=40)
    lines = plain.file.getvalue().splitlines()
    assert any(line.startswith("[rag] plan: tokenise 40/150 rows") and "rows/s" in line and "eta" in line
               for line in lines), lines
    assert any(line.startswith("[rag] plan: tokenise done: 150 rows") for line in lines)
    assert any(line.startswith("[rag] plan: sort done: 150 rows") for line in lines)
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    with PlanningProgress(terminal, "rag") as progress:
        build_work_plan(job, tmp_path / "b", progress=progress, window_rows=40)
    shown = terminal.file.getvalue()
    assert "tokenise" in shown and "150/150" in shown and "rows/s" in shown
