"""`batchinfer warmup`: one line per engine, bad input as a one-line error with exit 2."""
import yaml
from click.testing import CliRunner

from batchinfer.cli import main


def _job_file(tmp_path, model="demo", device="cpu"):
    jobs = {"jobs": [{"name": "rag", "model": model, "input": "missing.parquet",  # inputs are not read
                      "prompt": {"template": "{q}"}, "engine": {"device": device}},
                     {"name": "rag2", "model": model, "input": "missing.parquet",
                      "prompt": {"template": "{q}"}, "engine": {"device": device}}]}
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump(jobs))
    return path


def test_cpu_jobs_need_no_compiles_and_share_one_engine(tmp_path):
    result = CliRunner().invoke(main, ["warmup", str(_job_file(tmp_path))])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines() == ["warmup rag, rag2: cpu needs no kernel compiles"]


def test_bad_checkpoint_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["warmup", str(_job_file(tmp_path, model=str(tmp_path / "nope")))])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no such checkpoint folder" in lines[0]


def test_unknown_job_name(tmp_path):
    result = CliRunner().invoke(main, ["warmup", str(_job_file(tmp_path)), "--job", "other"])
    assert result.exit_code == 2 and result.output.startswith("error: ")
