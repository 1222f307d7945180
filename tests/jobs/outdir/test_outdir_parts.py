"""Part records and their verification on resume, against a fake engine."""
from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.outdir import part_store
from batchinfer.jobs.outdir.part_store import PARTS_DIR, UNIT_PART_PATTERN, commit_part, record_path, scan_parts
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet
from tests.job_process import damage_column

ROWS = 11


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def make_job(folder: Path, checkpoint: Path, **overrides) -> Path:
    """Unit parts of 5-row units in input order (the window plan); resume: tests/jobs/outdir/test_units_resume.py."""
    write_parquet(rag_table(ROWS), folder / "data" / "rag.parquet")
    return write_job_file(folder, [job_entry(model=str(checkpoint), sampling={"max_tokens": 5, "n": 2}, **overrides)])


def run(job_file: Path, engine: FakeEngine = None, overwrite: bool = False, warnings: list = None) -> dict:
    job = prepare_job(load_job_file(job_file).jobs[0], overwrite=overwrite)
    engine = engine or FakeEngine()
    return run_job(job, Console(quiet=True), overwrite=overwrite, engine_factory=lambda *_: engine, window_rows=5,
                   plan="window", warn=(warnings if warnings is not None else []).append)


def out_dir(folder: Path) -> Path:
    return folder / "out" / "rag"


def read_output(folder: Path) -> pa.Table:
    return pq.read_table(out_dir(folder)).sort_by([("row_index", "ascending"), ("sample_index", "ascending")])


def asked(engine: FakeEngine) -> int:
    return sum(req.sampling.n - len(req.skip_samples) for call in engine.calls for req in call)


def test_every_committed_part_has_a_record_of_its_size_rows_and_sha256(tmp_path, checkpoint):
    run(make_job(tmp_path, checkpoint))
    parts = sorted(out_dir(tmp_path).glob("part-*.parquet"))
    assert len(parts) > 2
    for part in parts:
        record = json.loads(record_path(out_dir(tmp_path), part.name).read_text())
        assert record == {"name": part.name, "bytes": part.stat().st_size, "rows": pq.read_metadata(part).num_rows,
                          "sha256": hashlib.sha256(part.read_bytes()).hexdigest()}
    assert read_output(tmp_path).num_rows == ROWS * 2  # the records are not read as data


@pytest.mark.parametrize("column", ["document", "row_index", "generated_text"])
def test_a_part_damaged_inside_a_column_is_moved_aside_and_its_rows_redone(tmp_path, checkpoint, column):
    job_file = make_job(tmp_path, checkpoint)
    run(job_file)
    reference = read_output(tmp_path).drop_columns(["cached_tokens"])
    part = sorted(out_dir(tmp_path).glob("part-*.parquet"))[1]
    lost = pq.read_metadata(part).num_rows
    damage_column(part, column)
    with pytest.raises(Exception):
        pq.read_table(out_dir(tmp_path))  # the damage is real: readers fail
    engine, warnings = FakeEngine(), []
    stats = run(job_file, engine, warnings=warnings)
    assert len(warnings) == 1 and warnings[0].startswith(f"{part}: damaged (its sha256 differs from its record)")
    assert f"moved to .{part.name}.damaged, its rows are redone" in warnings[0]
    assert (out_dir(tmp_path) / f".{part.name}.damaged").is_file()
    assert pq.read_metadata(part).num_rows == lost  # the unit's chunk, redone under its own name
    assert read_output(tmp_path).drop_columns(["cached_tokens"]).equals(reference)
    assert asked(engine) == lost == stats["samples_written"]
    assert stats["samples_resumed"] == ROWS * 2 - lost
    warnings.clear()
    run(job_file, warnings=warnings)  # now whole again: nothing to do, nothing to say
    assert warnings == []


def test_a_users_own_part_is_ignored_named_and_never_deleted(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint)
    folder = out_dir(tmp_path)
    folder.mkdir(parents=True)
    mine = folder / "part-00099.parquet"
    pq.write_table(pa.table({"mine": [1, 2]}), mine)
    own_bytes = mine.read_bytes()
    warnings = []
    stats = run(job_file, warnings=warnings)
    assert stats["samples_written"] == ROWS * 2 and stats["samples_resumed"] == 0
    assert warnings == [f"{mine}: not written by batchinfer (no record in {PARTS_DIR}/); ignored for resume and "
                        "left in place, but dataset readers of the folder will read it too"]
    ours = [p.name for p in folder.glob("part-*.parquet") if p != mine]
    assert ours and all(UNIT_PART_PATTERN.match(name) for name in ours)  # named by unit: never its name
    for overwrite in (False, True):
        stats = run(job_file, overwrite=overwrite)
        assert mine.read_bytes() == own_bytes
    assert stats["samples_written"] == ROWS * 2


def test_overwrite_deletes_only_what_batchinfer_wrote(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint)
    run(job_file)
    folder = out_dir(tmp_path)
    first = sorted(folder.glob("part-*.parquet"))[0]
    damage_column(first, "document")
    run(job_file)  # moves it aside
    assert (folder / f".{first.name}.damaged").exists()
    keep = {folder / "NOTES.txt": b"mine", folder / "part-00777.parquet": b"not a part of ours",
            folder / ".hidden": b"mine too"}
    for path, data in keep.items():
        path.write_bytes(data)
    run(job_file, overwrite=True)
    names = {p.name for p in folder.iterdir()}
    assert {path.name for path in keep} <= names and f".{first.name}.damaged" not in names
    assert all(path.read_bytes() == data for path, data in keep.items())
    ours = {p.name for p in folder.glob("part-*.parquet")} - {"part-00777.parquet"}
    assert {p.name for p in (folder / PARTS_DIR).iterdir()} == {f"{name}.json" for name in ours}


def test_a_commit_cut_between_record_and_rename_leaves_nothing_counted(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint)
    run(job_file)
    folder = out_dir(tmp_path)
    part = sorted(folder.glob("part-*.parquet"))[2]
    lost = pq.read_metadata(part).num_rows
    part.rename(folder / f".{part.name}.1234-abcd.tmp")  # as if killed just before the rename
    (folder / PARTS_DIR / ".part-00009.parquet.json.1234-abcd.tmp").write_text("{")
    engine = FakeEngine()
    stats = run(job_file, engine)
    assert asked(engine) == lost == stats["samples_written"]
    assert not [p for p in folder.rglob("*.tmp")]
    assert read_output(tmp_path).num_rows == ROWS * 2
    scan = scan_parts(folder)
    assert not scan.damaged and not scan.foreign and not scan.orphan_records


def test_a_folder_from_before_part_records_is_refused_until_overwrite(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint)
    run(job_file)
    folder = out_dir(tmp_path)
    manifest = json.loads((folder / "_job.json").read_text())
    (folder / "_job.json").write_text(json.dumps({**manifest, "version": 1}))
    for record in (folder / PARTS_DIR).iterdir():
        record.unlink()
    with pytest.raises(JobError, match=r"written by another batchinfer version \(manifest version 1"):
        run(job_file)
    stats = run(job_file, overwrite=True)  # its parts were batchinfer's: deleted, redone
    assert stats["samples_written"] == ROWS * 2 == read_output(tmp_path).num_rows


def test_writers_committing_the_same_part_at_once_never_collide(tmp_path):
    table = rag_table(50).append_column("row_index", pa.array(range(50), pa.int64())).append_column(
        "sample_index", pa.array([0] * 50, pa.int32()))
    errors = []

    def commit() -> None:
        try:
            for _ in range(10):
                commit_part(tmp_path, "part-00000.parquet", table)
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    writers = [threading.Thread(target=commit) for _ in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert errors == []
    scan = scan_parts(tmp_path)
    assert [path.name for path, _ in scan.finished] == ["part-00000.parquet"] and not scan.damaged
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_part_gets_its_final_name_only_after_its_record_is_durable(tmp_path, monkeypatch):
    def killed(*_args) -> None:  # the writer dies while writing the record
        raise KeyboardInterrupt

    table = pa.table({"row_index": pa.array([0, 1], pa.int64()), "sample_index": pa.array([0, 0], pa.int32())})
    monkeypatch.setattr(part_store, "write_atomically", killed)
    with pytest.raises(KeyboardInterrupt):
        commit_part(tmp_path, "part-00000.parquet", table)
    assert list(tmp_path.rglob("*")) == [tmp_path / PARTS_DIR]  # no part, no temporary
