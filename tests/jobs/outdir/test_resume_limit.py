"""`limit` on a rerun: raising it resumes (the new rows are added), lowering it is refused (the
folder would keep rows past the new limit and their stats) until --overwrite."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet
from tests.cli.test_cli_errors import run_cli

ROWS = 7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def run(folder: Path, checkpoint: Path, limit, overwrite: bool = False) -> dict:
    write_job_file(folder, [job_entry(model=str(checkpoint), limit=limit)])
    job = prepare_job(load_job_file(folder / "jobs.yaml").jobs[0], overwrite=overwrite)
    return run_job(job, Console(quiet=True), overwrite=overwrite, engine_factory=lambda *_: FakeEngine())


def rows_in(folder: Path) -> list[int]:
    return sorted(pq.read_table(folder / "out" / "rag")["row_index"].to_pylist())


def test_a_lower_limit_on_a_finished_folder_is_refused_and_overwrite_gives_exactly_its_rows(tmp_path, checkpoint):
    write_parquet(rag_table(ROWS), tmp_path / "data" / "rag.parquet")
    run(tmp_path, checkpoint, limit=3)
    assert rows_in(tmp_path) == [0, 1, 2]
    stats = run(tmp_path, checkpoint, limit=5)  # raised: resumes, adds rows 3 and 4
    assert rows_in(tmp_path) == [0, 1, 2, 3, 4] and stats["samples_resumed"] == 3 and stats["rows"] == 5
    run(tmp_path, checkpoint, limit=None)
    assert rows_in(tmp_path) == list(range(ROWS))
    with pytest.raises(JobError, match=r"out/rag was made for 7 rows and this run covers 2 \(limit lowered\); "
                                       r"use --overwrite to start again$"):
        run(tmp_path, checkpoint, limit=2)
    assert run_cli(tmp_path, "run", "jobs.yaml").endswith("covers 2 (limit lowered); use --overwrite to start again")
    assert rows_in(tmp_path) == list(range(ROWS))
    stats = run(tmp_path, checkpoint, limit=2, overwrite=True)
    assert rows_in(tmp_path) == [0, 1] and stats["rows"] == 2
