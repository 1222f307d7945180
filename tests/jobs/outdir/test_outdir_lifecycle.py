"""A run's counters and messages tell the truth: empty inputs, a full disk, memory labels, and an
input fingerprint that sees every edit (with the one documented way to add rows)."""
from __future__ import annotations

import errno
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.outdir import part_store
from batchinfer.jobs.errors import JobError, JobRuntimeError
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def run(job_file: Path, engine: FakeEngine = None, console: Console = None, overwrite: bool = False,
        plan: str = "global") -> dict:
    job = prepare_job(load_job_file(job_file).jobs[0], overwrite=overwrite)
    engine = engine or FakeEngine()
    return run_job(job, console or Console(quiet=True), overwrite=overwrite, engine_factory=lambda *_: engine,
                   window_rows=5, plan=plan)


def text_console() -> Console:
    return Console(file=io.StringIO(), width=120)


def test_an_empty_input_makes_its_folder_stats_and_summary(tmp_path, checkpoint):
    write_parquet(rag_table(0), tmp_path / "data" / "rag.parquet")
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint))])
    console = text_console()
    loaded = []
    job = prepare_job(load_job_file(job_file).jobs[0])
    run_job(job, console, engine_factory=lambda *_: loaded.append(1) or FakeEngine())
    shown = console.file.getvalue()
    assert "already in" not in shown and "job rag: done" in shown and loaded == []  # no model for no rows
    assert "peak memory (no engine loaded)" in shown
    stats = json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())
    assert (stats["status"], stats["rows"], stats["samples"], stats["samples_written"]) == ("done", 0, 0, 0)
    assert (tmp_path / "out" / "rag" / "_job.json").is_file()
    console = text_console()
    run(job_file, console=console)
    assert "job rag: all 0 samples already in" in console.file.getvalue()


class DiskFull:
    """The part write: fine for `parts` parts, then ENOSPC."""

    def __init__(self, write, parts: int) -> None:
        self.write, self.left = write, parts

    def __call__(self, table: pa.Table, path: Path) -> None:
        if self.left == 0:
            path.write_bytes(b"PAR1 half a part")
            raise OSError(errno.ENOSPC, "No space left on device")
        self.left -= 1
        self.write(table, path)


def test_after_a_full_disk_the_stats_count_only_what_is_on_disk(tmp_path, checkpoint, monkeypatch):
    rows = 13
    table = rag_table(rows, null_rows=(1,))
    write_parquet(table, tmp_path / "data" / "rag.parquet")
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), sampling={"max_tokens": 4, "n": 2})])
    monkeypatch.setattr(part_store, "_write_table", DiskFull(part_store._write_table, parts=2))
    with pytest.raises(JobRuntimeError, match="No space left on device"):
        run(job_file, plan="window")  # units of 5 rows, parts of flush_rows // n rows each
    out_dir = tmp_path / "out" / "rag"
    on_disk = pq.read_table(out_dir)
    stats = json.loads((out_dir / "_stats.json").read_text())
    assert stats["status"] == "failed" and len(list(out_dir.glob("part-*.parquet"))) == 2  # the two that fit
    assert 0 < on_disk.num_rows < rows * 2
    assert stats["samples_written"] == on_disk.num_rows
    assert stats["errors"] == sum(reason == "error" for reason in on_disk["finish_reason"].to_pylist())
    assert not [p for p in out_dir.rglob("*") if p.name.endswith(".tmp")]
    monkeypatch.undo()
    stats = run(job_file, plan="window")
    assert stats["samples_resumed"] == on_disk.num_rows and stats["samples_written"] == rows * 2 - on_disk.num_rows


class DeviceEngine(FakeEngine):
    def settings(self) -> dict:
        return {**super().settings(), "device": "cpu"}


def test_memory_figures_say_what_they_measure(tmp_path, checkpoint):
    write_parquet(rag_table(5), tmp_path / "data" / "rag.parquet")
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint))])
    console = text_console()
    stats = run(job_file, DeviceEngine(), console=console)
    assert stats["peak_memory_device"] == "cpu" and stats["process_peak_rss_bytes"] > 10 * 2**20
    shown = console.file.getvalue()
    assert "peak memory (engine, cpu)" in shown and "peak RSS (this process)" in shown
    assert json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())["process_peak_rss_bytes"] > 0


def uncompressed_input(path: Path, rows: int = 400) -> None:
    """A Parquet file well over 64 KiB, written plain (no compression, no dictionary)."""
    table = rag_table(rows)
    table = table.set_column(2, "question", pa.array([f"{q} {'x' * 300}" for q in table["question"].to_pylist()]))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="none", use_dictionary=False, write_statistics=False)


def test_a_same_size_edit_anywhere_in_the_input_is_seen(tmp_path, checkpoint):
    data = tmp_path / "data" / "rag.parquet"
    uncompressed_input(data)
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), limit=3)])
    run(job_file)
    raw = data.read_bytes()
    at = raw.index(b"Why? #3 ")  # a row near the start, far from the footer
    assert len(raw) - at > 2 * 2**16
    data.write_bytes(raw[:at] + b"How? #3 " + raw[at + 8:])
    assert pq.read_table(data)["question"][3].as_py().startswith("How? #3")
    with pytest.raises(JobError, match=r"made with different settings \(input changed\)"):
        run(job_file)


def test_files_added_after_the_last_input_file_resume_any_other_change_is_refused(tmp_path, checkpoint):
    write_parquet(rag_table(6), tmp_path / "data" / "a.parquet")
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), input="data")])
    run(job_file)
    write_parquet(rag_table(4), tmp_path / "data" / "b.parquet")  # sorts after a.parquet
    engine = FakeEngine()
    stats = run(job_file, engine)
    assert sorted(r.request_id for call in engine.calls for r in call) == [6, 7, 8, 9]
    assert stats["samples_resumed"] == 6 and stats["samples_written"] == 4
    out = pq.read_table(tmp_path / "out" / "rag")
    assert sorted(out["row_index"].to_pylist()) == list(range(10))
    for change in ("first", "earlier", "grown"):
        if change == "first":   # sorts before every file: every row index would move
            path = write_parquet(rag_table(2), tmp_path / "data" / "0.parquet")
        elif change == "earlier":  # an earlier file edited
            path = tmp_path / "data" / "a.parquet"
            original = path.read_bytes()
            write_parquet(rag_table(6).slice(0, 5), path)
        else:  # rows appended to the last file: refused too (add a file instead)
            path = tmp_path / "data" / "b.parquet"
            original = path.read_bytes()
            write_parquet(rag_table(5), path)
        with pytest.raises(JobError, match=r"\(input changed\)"):
            run(job_file)
        if change == "first":
            path.unlink()
        else:
            path.write_bytes(original)
    engine = FakeEngine()
    run(job_file, engine)  # back as it was: resumes, with nothing to do
    assert engine.calls == []
