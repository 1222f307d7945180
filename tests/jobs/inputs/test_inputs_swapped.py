"""An input file replaced while the job runs (`mv` of another Parquet onto it): a one-line error
(exit 2) at the first read that sees it, never rows mixing the two versions; after the original
is put back, the rerun completes from it alone. Real `batchinfer run` processes on the demo model,
the swap made from inside at a chosen read."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.job_process import REPO_ROOT, demo_cache, read_parts, start_run, write_demo_job  # noqa: F401
from tests.jobs_fixtures import rag_table, write_parquet

pytestmark = pytest.mark.slow
ROWS = 10

SWAP_AT = """
import os, sys, importlib
module, name, path, other = sys.argv[1:5]
target = importlib.import_module(module)
original = getattr(target, name)
def swap_first(*args, **kwargs):
    if not os.path.exists(path + ".orig"):
        os.rename(path, path + ".orig")
        os.rename(other, path)  # mv other.parquet data/rag.parquet
    return original(*args, **kwargs)
setattr(target, name, swap_first)
from batchinfer.cli import main
sys.argv = ["batchinfer", "run", "jobs.yaml"]
main()
"""


def other_version() -> pa.Table:
    """Same schema and row count, other rows: its prompts and carried columns differ row by row."""
    return rag_table(ROWS + 5).slice(5)


def swap_during_run(folder: Path, demo_cache: Path, module: str, name: str) -> subprocess.CompletedProcess:
    data = folder / "data" / "rag.parquet"
    write_parquet(other_version(), folder / "other.parquet")
    env = {**os.environ, "BATCHINFER_CACHE_DIR": str(demo_cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", SWAP_AT, module, name, str(data), str(folder / "other.parquet")],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pa.Table:
    """The job's output without a swap (demo model, greedy: the same whatever the plan mode)."""
    folder = tmp_path_factory.mktemp("reference")
    cache = tmp_path_factory.getbasetemp() / "demo-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHINFER_CACHE_DIR", str(cache))
        from batchinfer.demo import demo_checkpoint

        demo_checkpoint()
    out = write_demo_job(folder, ROWS)
    run_to_end(folder, cache)
    return read_parts(out)


def run_to_end(folder: Path, demo_cache: Path) -> str:
    process = start_run(folder, demo_cache)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    return stderr


# (The window plan, whose only read is `window_run.iter_windows`, is a benchmark arm, not a job key.)
@pytest.mark.parametrize("module, name", [
    ("batchinfer.jobs.global_plan.store", "spill_prompts"),   # _work/ made, nothing read yet
    ("batchinfer.jobs.global_plan.unit_inputs", "_spill_rows"),          # sorted rows and units committed
], ids=["planning-pass", "unit-input-buckets"])
def test_an_input_swapped_mid_run_is_exit_2_and_the_rerun_after_restoring_uses_it_alone(
        tmp_path, demo_cache, reference, module, name):
    folder = tmp_path / "job"
    out = write_demo_job(folder, ROWS, engine={"max_running": 3, "device": "cpu"})
    child = swap_during_run(folder, demo_cache, module, name)
    lines = child.stderr.strip().splitlines()
    assert child.returncode == 2, child.stderr
    assert lines[-1] == ("error: jobs.yaml: jobs.rag.input: data/rag.parquet changed since the job started "
                         "(replaced or written to); rerun once the input is final"), child.stderr
    assert "Traceback" not in child.stderr
    assert not list(out.glob("part-*.parquet"))  # no row of either version was written
    os.replace(folder / "data" / "rag.parquet.orig", folder / "data" / "rag.parquet")  # the original back
    stderr = run_to_end(folder, demo_cache)
    assert "already in" not in stderr
    got, expected = read_parts(out), reference
    columns = ["row_index", "sample_index", "qid", "document", "question", "extra", "prompt_tokens",
               "output_token_ids", "generated_text"]
    assert got.select(columns).equals(expected.select(columns))
