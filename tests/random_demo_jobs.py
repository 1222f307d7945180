"""Job files run through `batchinfer run` (in this process) on the random demo checkpoint: real engine
and CLI, tiny and fast, shared by the tests of what jobs write (tests/cli/test_outputs_doc.py, tests/jobs/formats/test_openai_examples.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.demo import demo_checkpoint
from tests.job_process import run_in_this_process
from tests.jobs_fixtures import write_job_file


def run_random_demo_jobs(folder: Path, cache: Path, jobs: list[dict]) -> Path:
    """Write `jobs` to `folder`/jobs.yaml and run them all on `model: demo` built at random into `cache`
    (exit 0 asserted); → `folder`/out."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(cache))
        monkeypatch.setenv("BATCHINFER_DEMO", "random")
        demo_checkpoint()
        write_job_file(folder, jobs)
        result = run_in_this_process(folder)
    finally:
        monkeypatch.undo()
    assert result.exit_code == 0, result.output
    return folder / "out"
