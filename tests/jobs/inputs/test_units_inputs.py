"""Each unit's input columns in buckets (a unit reads only its rows), the planning pass's progress,
and the rewrite in input order over more parts than its fan-in, unsorted parts included."""
from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.outdir import ordered_output
from batchinfer.jobs.global_plan import UnitConfig, build_work_plan, work_dir_for
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from batchinfer.jobs.global_plan.unit_inputs import UnitInputs, build_unit_inputs, inputs_dir_for
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

ROWS = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def shuffled(rows: int = ROWS) -> pa.Table:
    order = list(range(rows))
    random.Random(11).shuffle(order)
    return rag_table(rows, null_rows=(3,)).take(order)


def make_job(folder: Path, checkpoint: Path, **overrides) -> Path:
    write_parquet(shuffled(), folder / "data" / "rag.parquet", row_group_size=6)
    entry = dict(model=str(checkpoint), sampling={"max_tokens": 4, "n": 2}, output={"path": "out/rag", "flush_rows": 4})
    entry.update(overrides)
    return write_job_file(folder, [job_entry(**entry)])


def test_a_unit_reads_exactly_its_rows_from_row_groups_cut_at_unit_boundaries(tmp_path, checkpoint):
    job = prepare_job(load_job_file(make_job(tmp_path, checkpoint)).jobs[0])
    plan = build_work_plan(job, tmp_path / "work", UnitConfig(max_rows=3, units_goal=1))
    inputs = build_unit_inputs(job, plan, bucket_bytes=600, spill_bytes=300, group_rows=2)
    folder = inputs_dir_for(plan)
    buckets = sorted(folder.glob("bucket-*.parquet"))
    assert len(plan.units) > 8 and 3 <= len(buckets) < len(plan.units)  # several units a bucket, many buckets
    table = shuffled()
    seen = []
    for unit in plan.units:
        rows = sorted(row.row_index for row in plan.read_unit(unit.unit_id))
        got = inputs.read(unit.unit_id)
        assert got["row_index"].to_pylist() == rows
        assert got.drop_columns(["row_index"]).equals(table.take(rows))  # every input column, as it was
        seen += rows
    assert sorted(seen) == list(range(ROWS))
    for bucket_index, bucket in enumerate(buckets):  # a row group never starts inside a unit
        first = inputs.layout.first_units[bucket_index]
        stop = inputs.layout.first_units[bucket_index + 1] if bucket_index + 1 < len(buckets) else len(plan.units)
        unit_starts = set(np.cumsum([0] + [u.rows for u in plan.units[first:stop]]).tolist())
        metadata = pq.read_metadata(bucket)
        group_starts = np.cumsum([0] + [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])
        assert set(group_starts.tolist()) <= unit_starts
    assert not list(folder.glob("*.arrow"))  # the pass-1 spill is gone
    again = build_unit_inputs(job, plan)  # committed for these units: reused, not rebuilt
    assert again.layout == inputs.layout and {p.name: p.stat().st_mtime_ns for p in buckets} == \
        {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("bucket-*.parquet"))}
    recut = build_work_plan(job, tmp_path / "work", UnitConfig(max_rows=5, units_goal=1))
    assert UnitInputs.open(recut) is None
    build_unit_inputs(job, recut)
    assert not folder.exists() and inputs_dir_for(recut).is_dir()  # the other units' inputs are gone


def test_the_planning_pass_shows_its_phases_before_generation(tmp_path, checkpoint):
    job = prepare_job(load_job_file(make_job(tmp_path, checkpoint)).jobs[0])
    console = Console(file=io.StringIO(), width=200)  # not a terminal: plain lines
    run_job(job, console, engine_factory=lambda *_: FakeEngine(), unit_config=UnitConfig(max_rows=4, units_goal=1))
    lines = console.file.getvalue().splitlines()
    phases = [line for line in lines if line.startswith("[rag] plan: ")]
    assert [p.split(":")[1].split()[0] for p in phases if " done: " in p] == ["tokenise", "sort", "inputs"]
    assert all(f"{ROWS:,} rows in" in p for p in phases if " done: " in p)
    summary = next(i for i, line in enumerate(lines) if "units, global ideal" in line)
    first_sample = next(i for i, line in enumerate(lines) if "samples already done" in line)
    assert summary < first_sample


@pytest.mark.parametrize("first_plan", ["global", "window"])
def test_input_order_over_more_parts_than_the_fan_in(tmp_path, checkpoint, monkeypatch, first_plan):
    """window: the first run writes numbered parts in completion order (unsorted inside)."""
    monkeypatch.setattr(ordered_output, "FAN_IN", 3)
    monkeypatch.setattr(ordered_output, "BATCH_ROWS", 3)
    run_job(prepare_job(load_job_file(make_job(tmp_path, checkpoint)).jobs[0]), Console(quiet=True),
            engine_factory=lambda *_: FakeEngine(), unit_config=UnitConfig(max_rows=4, units_goal=1), plan=first_plan)
    out = tmp_path / "out" / "rag"
    before = pq.read_table(out).sort_by([("row_index", "ascending"), ("sample_index", "ascending")])
    assert len(list(out.glob("part-*.parquet"))) > 9  # more than two merge passes of 3
    job = prepare_job(load_job_file(make_job(tmp_path, checkpoint,
                                             output={"path": "out/rag", "flush_rows": 4, "order": "input"})).jobs[0])
    run_job(job, Console(quiet=True), engine_factory=lambda *_: FakeEngine(), plan=first_plan)
    parts = sorted(out.glob("part-*.parquet"))
    ordered = pa.concat_tables(pq.read_table(p) for p in parts)
    assert list(zip(ordered["row_index"].to_pylist(), ordered["sample_index"].to_pylist())) == \
        [(r, s) for r in range(ROWS) for s in range(2)]
    assert ordered.equals(before)
    assert not (work_dir_for(out) / ".compact").exists()
