"""An input glob that also matches the job's own output folder: its parts are never inputs."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.cli_utils import invoke_cli, table_cells
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

ROWS = 7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def run(job_file: Path, overwrite: bool = False) -> None:
    job = prepare_job(load_job_file(job_file).jobs[0], overwrite=overwrite)
    assert job.inputs.num_rows == ROWS
    run_job(job, Console(quiet=True), overwrite=overwrite, engine_factory=lambda _job, _rows: FakeEngine())


def test_a_glob_over_the_output_folder_reads_only_the_input_on_every_rerun(tmp_path, checkpoint):
    write_parquet(rag_table(ROWS), tmp_path / "data" / "rag.parquet")
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), input="data/**/*.parquet",
                                                   output={"path": "data/out/rag", "flush_rows": 3})])
    out = tmp_path / "data" / "out" / "rag"
    run(job_file)
    assert len(list(out.glob("part-*.parquet"))) == 3
    run(job_file)  # resumes: nothing to do (the parts made a second, different schema before)
    run(job_file, overwrite=True)
    assert pq.read_table(out).num_rows == ROWS
    result = invoke_cli(tmp_path, "plan", "jobs.yaml")
    assert result.exit_code == 0, result.output
    assert ["rows", str(ROWS)] in table_cells(result.stdout)


def test_a_glob_that_matches_only_output_parts_names_the_output_folder(tmp_path, checkpoint):
    write_parquet(rag_table(ROWS), tmp_path / "out" / "rag" / "part-00000.parquet")
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), input="out/**/*.parquet")])
    with pytest.raises(JobError, match=r"jobs\.rag\.input: no files match outside the job's output folder "
                                       r".*out/rag: .*out/\*\*/\*\.parquet$"):
        prepare_job(load_job_file(job_file).jobs[0])
