"""Output folders may not nest: not across the jobs of one file, not inside (or around) an existing
batchinfer output folder. One job's rerun or --overwrite would delete the other's files, and
`pq.read_table` of the outer folder would read both jobs' rows."""
from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet
from tests.cli.test_cli_errors import run_cli


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def jobs_with_outputs(folder: Path, checkpoint: Path, outputs: list[str]) -> None:
    write_parquet(rag_table(7), folder / "data" / "rag.parquet")
    write_job_file(folder, [job_entry(name=f"j{i}", model=str(checkpoint), output={"path": path})
                            for i, path in enumerate(outputs)])


@pytest.mark.parametrize("outputs, line", [
    (["out/a", "out/a/_work/c", "out/a/_parts/d", "out/a/b"], "jobs.j1.output: out/a/_work/c is inside out/a, the "
                                                              "output folder of job j0: "),
    (["out/a/_parts/d", "out/a"], "jobs.j1.output: out/a contains out/a/_parts/d, the output folder of job j0: "),
    (["out/a", "out/x", "out/a/b"], "jobs.j2.output: out/a/b is inside out/a, the output folder of job j0: "),
    (["out/a", "out/a/../a"], "jobs.j1.output: same output folder as job j0"),
], ids=["four-in-one-file", "outer-after-inner", "third-job", "same-by-another-name"])
def test_nested_output_folders_in_one_job_file_are_one_line_and_exit_2(tmp_path, checkpoint, outputs, line):
    jobs_with_outputs(tmp_path, checkpoint, outputs)
    assert run_cli(tmp_path, "run", "jobs.yaml").startswith(f"error: jobs.yaml: {line}")


def test_a_job_symlinked_into_another_jobs_output_folder_is_refused(tmp_path, checkpoint):
    (tmp_path / "out" / "a").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "out" / "a")
    jobs_with_outputs(tmp_path, checkpoint, ["out/a", str(tmp_path / "link" / "b")])  # absolute: kept as written
    assert "link/b is inside out/a, the output folder of job j0" in run_cli(tmp_path, "run", "jobs.yaml")


@pytest.mark.parametrize("second, line", [
    ("out/a/b", "out/a/b is inside out/a, the output folder of another batchinfer job (it holds _job.json, "
                "_stats.json, _parts): "),
    ("out/a/_parts/d", "out/a/_parts/d is inside out/a, the output folder of another batchinfer job"),
    ("out", "out contains out/a, the output folder of another batchinfer job"),
])
def test_an_output_folder_inside_or_around_an_earlier_jobs_output_is_refused(tmp_path, checkpoint, second, line):
    jobs_with_outputs(tmp_path, checkpoint, ["out/a"])
    job = prepare_job(load_job_file(tmp_path / "jobs.yaml").jobs[0])
    run_job(job, Console(quiet=True), engine_factory=lambda *_: FakeEngine())
    assert (tmp_path / "out" / "a" / "_job.json").is_file()
    write_job_file(tmp_path, [job_entry(name="other", model=str(checkpoint), output={"path": second})],
                   name="other.yaml")
    for command in ("run", "plan"):
        message = run_cli(tmp_path, command, "other.yaml")
        assert message.startswith(f"error: other.yaml: jobs.other.output: {line}"), message
    rerun = prepare_job(load_job_file(tmp_path / "jobs.yaml").jobs[0])  # the earlier job itself still resumes
    assert rerun.spec.output.path == tmp_path / "out" / "a"
