"""Unit by unit against a fake engine: parts fixed by the unit, resume, output.order input, the
planning folder's life cycle, and kill -9 at chosen points of planning, generation and the
rewrite in input order (real processes, killed by SIGKILL from inside at that point)."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.global_plan import UnitConfig, open_work_plan, work_dir_for
from batchinfer.jobs.outdir.ordered_output import finish_interrupted_compaction
from batchinfer.jobs.outdir.part_store import UNIT_PART_PATTERN, record_path
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from batchinfer.jobs.run.unit_runner import UnitRunner
from tests.fake_engine import FakeEngine
from tests.job_process import damage_column
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

pytestmark = pytest.mark.slow  # kill -9 and rerun of whole jobs

REPO_ROOT = Path(__file__).resolve().parents[3]
ROWS = 30
UNITS = UnitConfig(max_rows=4, units_goal=1)   # several units of whole groups (plus split ones)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def shuffled_table(rows: int = ROWS) -> pa.Table:
    table = rag_table(rows, null_rows=(7,))
    order = list(range(rows))
    random.Random(2).shuffle(order)
    return table.take(order)


def make_job(folder: Path, checkpoint: Path, table: pa.Table = None, **overrides) -> Path:
    write_parquet(shuffled_table() if table is None else table, folder / "data" / "rag.parquet", row_group_size=7)
    entry = dict(model=str(checkpoint), sampling={"max_tokens": 5, "n": 2, "seed": 3},
                 output={"path": "out/rag", "flush_rows": 4})
    entry.update(overrides)
    return write_job_file(folder, [job_entry(**entry)])


def run(job_file: Path, engine: FakeEngine = None, overwrite: bool = False, warnings: list = None,
        executor=None) -> dict:
    job = prepare_job(load_job_file(job_file).jobs[0], overwrite=overwrite)
    engine = engine or FakeEngine()
    return run_job(job, Console(quiet=True), overwrite=overwrite, engine_factory=lambda *_: engine,
                   warn=(warnings if warnings is not None else []).append, unit_config=UNITS, executor=executor)


def out_of(folder: Path) -> Path:
    return folder / "out" / "rag"


def parts_of(folder: Path) -> list[Path]:
    return sorted(out_of(folder).glob("part-*.parquet"))


def read_output(folder: Path, sort: bool = True) -> pa.Table:
    table = pa.concat_tables(pq.read_table(p) for p in parts_of(folder))
    return table.sort_by([("row_index", "ascending"), ("sample_index", "ascending")]) if sort else table


def pairs(table: pa.Table) -> list[tuple[int, int]]:
    return list(zip(table["row_index"].to_pylist(), table["sample_index"].to_pylist()))


def comparable(table: pa.Table) -> pa.Table:
    return table.drop_columns(["cached_tokens"])  # cache hits depend on what ran before, not the results


def all_pairs(rows: int = ROWS, n: int = 2) -> list[tuple[int, int]]:
    return [(r, s) for r in range(rows) for s in range(n)]


@pytest.fixture
def reference(tmp_path, checkpoint) -> pa.Table:
    folder = tmp_path / "reference"
    run(make_job(folder, checkpoint))
    return read_output(folder)


def test_units_write_every_pair_once_in_parts_fixed_by_the_unit_beside_every_input_column(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint)
    engine = FakeEngine()
    stats = run(job_file, engine)
    out = read_output(tmp_path)
    assert pairs(out) == all_pairs()
    table = shuffled_table()
    for name in table.column_names:  # every input column beside its own row's results
        assert out[name].to_pylist() == [v for v in table[name].to_pylist() for _ in range(2)]
    error_rows = [r for r in out.to_pylist() if r["error"] is not None]
    original_row_7 = table["qid"].to_pylist().index("q0007")
    assert {r["row_index"] for r in error_rows} == {original_row_7}
    assert all(r["error"] == "template column 'document' is null" for r in error_rows)
    names = [p.name for p in parts_of(tmp_path)]
    assert names and all(UNIT_PART_PATTERN.match(name) for name in names)
    assert len(engine.calls) == stats["plan"]["units"] > 3  # one engine unit per work unit
    assert all(len(call) <= UNITS.max_rows for call in engine.calls)
    for part in parts_of(tmp_path):  # each part sorted, and at most flush_rows samples
        keys = pairs(pq.read_table(part))
        assert keys == sorted(keys) and len(keys) <= 4
    assert stats["samples_written"] == ROWS * 2 and stats["errors"] == 2
    assert not work_dir_for(out_of(tmp_path)).exists()  # deleted when the job completes


def test_keep_work_keeps_the_planning_folder_and_a_rerun_reuses_it(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint, output={"path": "out/rag", "flush_rows": 4, "keep_work": True})
    stats = run(job_file)
    work = work_dir_for(out_of(tmp_path))
    assert stats["plan"]["reused_work_dir"] is False and (work / "plan.json").is_file()
    plan = open_work_plan(work)
    assert stats["plan"]["units"] == len(plan.units)
    assert stats["plan"]["global_ideal_cached_tokens"] == plan.summary.ideal_cached_tokens
    damage_column(parts_of(tmp_path)[0], "generated_text")  # something left to run
    stats = run(job_file)
    assert stats["plan"]["reused_work_dir"] is True
    sentinel = work / "sentinel"
    sentinel.write_text("from the earlier plan")
    stats = run(job_file, overwrite=True)
    assert stats["plan"]["reused_work_dir"] is False and not sentinel.exists()


def test_a_damaged_unit_part_is_moved_aside_and_rewritten_under_its_name(tmp_path, checkpoint, reference):
    job_file = make_job(tmp_path, checkpoint)
    run(job_file)
    part = parts_of(tmp_path)[2]
    lost = pq.read_metadata(part).num_rows
    before = {p.name: p.read_bytes() for p in parts_of(tmp_path) if p != part}
    damage_column(part, "row_index")
    engine, warnings = FakeEngine(), []
    stats = run(job_file, engine, warnings=warnings)
    assert len(warnings) == 1 and f"{part.name}: damaged" in warnings[0]
    assert part.is_file() and record_path(out_of(tmp_path), part.name).is_file()  # the same name again
    assert {p.name: p.read_bytes() for p in parts_of(tmp_path) if p != part} == before  # others untouched
    assert comparable(read_output(tmp_path)).equals(comparable(reference))
    assert stats["samples_written"] == lost == sum(2 - len(r.skip_samples) for call in engine.calls for r in call)


def test_output_order_input_writes_numbered_parts_in_input_order(tmp_path, checkpoint, reference):
    job_file = make_job(tmp_path, checkpoint, output={"path": "out/rag", "flush_rows": 4, "order": "input"})
    stats = run(job_file)
    names = [p.name for p in parts_of(tmp_path)]
    assert names == [f"part-{i:05d}.parquet" for i in range(len(names))] and len(names) == -(-ROWS * 2 // 4)
    in_order = read_output(tmp_path, sort=False)
    assert pairs(in_order) == all_pairs()
    assert comparable(in_order).equals(comparable(reference))
    assert pairs(pq.read_table(out_of(tmp_path))) == all_pairs()  # what a dataset reader sees
    assert sorted(p.name for p in (out_of(tmp_path) / "_parts").iterdir()) == [f"{n}.json" for n in names]
    assert stats["samples_written"] == ROWS * 2 and not (out_of(tmp_path) / "_compact.json").exists()


def test_order_input_after_a_completion_order_run_rewrites_without_running(tmp_path, checkpoint):
    run(make_job(tmp_path, checkpoint))
    job_file = make_job(tmp_path, checkpoint, output={"path": "out/rag", "flush_rows": 4, "order": "input"})
    loaded = []
    job = prepare_job(load_job_file(job_file).jobs[0])
    run_job(job, Console(quiet=True), engine_factory=lambda *_: loaded.append(1) or FakeEngine(), unit_config=UNITS)
    assert loaded == [] and pairs(read_output(tmp_path, sort=False)) == all_pairs()


def test_an_input_that_grew_retires_unit_parts_of_the_earlier_plan(tmp_path, checkpoint, reference):
    table = shuffled_table()
    write_parquet(table.slice(0, 18), tmp_path / "data" / "a.parquet")
    job_file = make_job(tmp_path, checkpoint, input="data/[ab].parquet")
    (tmp_path / "data" / "rag.parquet").unlink()
    run(job_file)
    first = {p.name: pq.read_table(p) for p in parts_of(tmp_path)}
    write_parquet(table.slice(18), tmp_path / "data" / "b.parquet")  # sorts after a.parquet: resumes
    stats = run(job_file)
    out = read_output(tmp_path)
    assert pairs(out) == all_pairs() and stats["samples_resumed"] == 18 * 2
    assert comparable(out).equals(comparable(reference))
    # every pair of the first run is still on disk, under its name or a numbered one
    kept = pa.concat_tables(pq.read_table(p) for p in parts_of(tmp_path))
    first_pairs = {pair for table in first.values() for pair in pairs(table)}
    assert first_pairs <= set(pairs(kept))


def test_a_unit_run_twice_rewrites_its_names_and_the_executor_seam_gets_the_plan(tmp_path, checkpoint, reference):
    """What a parallel executor does: run each unit with run_units([unit]) in a worker; an attempt
    that repeats a unit (its worker was thought dead) skips what is committed."""
    job_file = make_job(tmp_path, checkpoint)
    calls = []

    def executor(job, plan, out_dir, console, unit_ids):
        calls.append(plan)
        assert unit_ids == [unit.unit_id for unit in plan.iter_units_by_cost()]  # none finished yet
        engine = FakeEngine()
        runner = UnitRunner(job, engine, plan, out_dir, None)
        results = {}
        for unit_id in unit_ids:
            results[unit_id] = next(iter(runner.run_units([unit_id])))
        again = list(runner.run_units([plan.units[0].unit_id]))  # a repeated attempt
        assert again[0].samples_written == 0 and again[0].parts == results[plan.units[0].unit_id].parts
        return type("Report", (), {"status": "done", "failure": None, "stats": {"workers": 1},
                                   "results": results})()

    stats = run(job_file, executor=executor)
    assert len(calls) == 1
    out = read_output(tmp_path)
    assert comparable(out).equals(comparable(reference))
    assert stats["samples_written"] == ROWS * 2 and stats["executor"] == {"workers": 1}
    assert stats["prompt_tokens"] == sum(out["prompt_tokens"].to_pylist())


KILL_AT = """
import os, signal, sys, importlib
from pathlib import Path
from rich.console import Console
from batchinfer.jobs.global_plan import UnitConfig
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
job_file, module, name, after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
target = importlib.import_module(module)
original, calls = getattr(target, name), [0]
def kill_after(*args, **kwargs):
    calls[0] += 1
    if calls[0] > after:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)
setattr(target, name, kill_after)
job = prepare_job(load_job_file(Path(job_file)).jobs[0])
run_job(job, Console(quiet=True), engine_factory=lambda *_: FakeEngine(),
        unit_config=UnitConfig(max_rows=4, units_goal=1))
"""


def kill_at(job_file: Path, module: str, name: str, after: int) -> None:
    """Run the job in a child process that SIGKILLs itself at the (after + 1)-th call of module.name."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", KILL_AT, str(job_file), module, name, str(after)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr


@pytest.mark.parametrize("module, name", [
    ("batchinfer.jobs.global_plan.store", "write_sorted_rows"),   # runs spilled, the global merge starting
    ("batchinfer.jobs.global_plan.store", "_write_units"),        # sorted rows written, units cut
    ("batchinfer.jobs.global_plan.unit_inputs", "_write_bucket"),             # plan committed, inputs being bucketed
], ids=["sort", "units", "inputs"])
def test_kill_9_during_planning_then_a_rerun_is_right(tmp_path, checkpoint, reference, module, name):
    job_file = make_job(tmp_path, checkpoint)
    kill_at(job_file, module, name, after=0)
    assert not parts_of(tmp_path) and work_dir_for(out_of(tmp_path)).is_dir()
    stats = run(job_file)
    assert stats["plan"]["reused_work_dir"] is (name == "_write_bucket")  # a committed spill is reused
    out = read_output(tmp_path)
    assert pairs(out) == all_pairs() and comparable(out).equals(comparable(reference))


def test_kill_9_during_generation_then_a_rerun_completes_each_pair_once(tmp_path, checkpoint, reference):
    job_file = make_job(tmp_path, checkpoint)
    kill_at(job_file, "batchinfer.jobs.outdir.part_writer", "commit_part", after=5)
    before = {p.name: p.read_bytes() for p in parts_of(tmp_path)}
    assert len(before) == 5
    stats = run(job_file)
    out = read_output(tmp_path)
    assert pairs(out) == all_pairs() and comparable(out).equals(comparable(reference))
    assert {name: (out_of(tmp_path) / name).read_bytes() for name in before} == before  # never rewritten
    assert stats["plan"]["reused_work_dir"] is True
    assert stats["samples_resumed"] == sum(pq.read_metadata(out_of(tmp_path) / n).num_rows for n in before)


@pytest.mark.parametrize("module, name, after", [
    ("batchinfer.jobs.outdir.ordered_output", "commit_part", 3),     # some parts in input order written
    ("batchinfer.jobs.outdir.ordered_output", "_delete_part", 2),    # all written, sources being removed
], ids=["merge", "remove"])
def test_kill_9_during_the_rewrite_in_input_order_then_each_pair_once(tmp_path, checkpoint, reference, module,
                                                                      name, after):
    job_file = make_job(tmp_path, checkpoint, output={"path": "out/rag", "flush_rows": 4, "order": "input"})
    kill_at(job_file, module, name, after)
    assert (out_of(tmp_path) / "_compact.json").is_file()
    on_disk = pairs(read_output(tmp_path))
    assert len(on_disk) > len(set(on_disk)) or name == "_delete_part"  # mid-merge: copies on disk
    undone = tmp_path / "undone"  # what the rerun's first step leaves, on a copy
    shutil.copytree(tmp_path / "out", undone / "out")
    finish_interrupted_compaction(out_of(undone))
    assert sorted(pairs(read_output(undone))) == all_pairs()  # each pair once before anything is merged again
    warnings = []
    stats = run(job_file, warnings=warnings)
    assert len(warnings) == 1 and ("rolled back" if name == "commit_part" else "completed") in warnings[0]
    out = read_output(tmp_path, sort=False)
    assert pairs(out) == all_pairs() and comparable(out).equals(comparable(reference))
    assert all(not UNIT_PART_PATTERN.match(p.name) for p in parts_of(tmp_path))
    assert not (out_of(tmp_path) / "_compact.json").exists() and stats["status"] == "done"
    assert json.loads((out_of(tmp_path) / "_stats.json").read_text())["samples"] == ROWS * 2


def test_a_failed_run_keeps_every_finished_sample_and_the_rerun_completes_each_pair_once(tmp_path, checkpoint):
    from batchinfer.jobs.errors import JobRuntimeError

    table = rag_table(ROWS).take(list(reversed(range(ROWS))))  # no error row: every sample is the engine's
    output = {"path": "out/rag", "flush_rows": 8}
    run(make_job(tmp_path / "reference", checkpoint, table=table, output=output))
    job_file = make_job(tmp_path, checkpoint, table=table, output=output)
    with pytest.raises(JobRuntimeError, match="out of memory"):
        run(job_file, FakeEngine(fail_after=13))
    # 13 samples came out of the fake, which holds each back until the next: 12 reached the runner,
    # in whole chunks and in partial ones, and all 12 are on disk.
    assert len(pairs(read_output(tmp_path))) == 12
    stats = run(job_file)
    out = read_output(tmp_path)
    assert pairs(out) == all_pairs() and comparable(out).equals(comparable(read_output(tmp_path / "reference")))
    assert stats["samples_resumed"] == 12
