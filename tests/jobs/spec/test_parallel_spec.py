"""The `parallel:` block at validation: `executor: ray` where Ray is missing is one line, exit 2, for run and plan."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import batchinfer.jobs.spec.executors as executor_names
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet
from tests.cli.test_cli_errors import run_cli

REPO_ROOT = Path(__file__).resolve().parents[3]
RAY_MISSING_LINE = ("error: jobs.yaml: jobs.rag.parallel.executor: ray needs Ray, which is not installed "
                    "(pip install 'batchinfer[ray]')")


@pytest.fixture
def ray_job(tmp_path) -> Path:
    checkpoint = make_tokenizer_checkpoint(tmp_path / "ckpt")
    write_parquet(rag_table(5), tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint), parallel={"executor": "ray", "workers": 2})])
    return tmp_path


@pytest.mark.parametrize("command", ["run", "plan"])
def test_ray_executor_without_ray_is_one_line_before_anything_runs(ray_job, monkeypatch, command):
    monkeypatch.setattr(executor_names.importlib.util, "find_spec", lambda name: None)
    assert run_cli(ray_job, command, "jobs.yaml") == RAY_MISSING_LINE


@pytest.mark.slow
def test_ray_hidden_from_a_real_process_is_the_same_line(ray_job):
    # The package itself made unimportable (None in sys.modules), not the finder patched.
    code = "import sys; sys.modules['ray'] = None; from batchinfer.cli import main; main(['run', 'jobs.yaml'])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], cwd=ray_job, env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr.strip()) == (2, "", RAY_MISSING_LINE)
    assert not (ray_job / "out").exists()
