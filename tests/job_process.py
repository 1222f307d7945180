"""`batchinfer run` as a real process on the demo model, for tests of what only a process shows
(signals, kill -9, two runs at once). Jobs run on the CPU everywhere, so a fast GPU cannot finish
a job before the test acts on it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.demo import demo_checkpoint
from tests.cli_utils import invoke_cli
from tests.jobs_fixtures import job_entry, rag_table, write_job_file, write_parquet

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def demo_cache(tmp_path_factory, monkeypatch) -> Path:
    """One demo checkpoint for the whole session (the build is idempotent and cached)."""
    cache = tmp_path_factory.getbasetemp() / "demo-cache"
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(cache))
    demo_checkpoint()
    return cache


def write_demo_job(folder: Path, rows: int, table: pa.Table = None, **overrides) -> Path:
    """A CPU demo job over `rows` rag rows, output `out/rag`; → the output folder."""
    write_parquet(rag_table(rows) if table is None else table, folder / "data" / "rag.parquet")
    entry = {"model": "demo", "sampling": {"max_tokens": 6, "ignore_eos": True},
             "engine": {"max_running": 3, "device": "cpu"}, "output": {"path": "out/rag", "flush_rows": 3}}
    entry.update(overrides)
    write_job_file(folder, [job_entry(**entry)])
    return folder / "out" / "rag"


def start_run(folder: Path, demo_cache: Path, *args: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    env = {**os.environ, "BATCHINFER_CACHE_DIR": str(demo_cache), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "batchinfer", "run", "jobs.yaml", *args], cwd=folder, env=env,
                            stdout=stdout, stderr=subprocess.PIPE, text=True)


def run_in_this_process(folder: Path, *args: str):
    """`batchinfer run jobs.yaml ...` through click's runner, in `folder` (no interpreter start-up)."""
    return invoke_cli(folder, "run", "jobs.yaml", *args)


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, seconds: float = 120) -> None:
    """Poll until `condition()` holds, the process ends or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while not condition() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def read_parts(out_dir: Path) -> pa.Table:
    parts = sorted(out_dir.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by(
        [("row_index", "ascending"), ("sample_index", "ascending")])


def keys(table: pa.Table) -> list[tuple[int, int]]:
    return sorted(zip(table["row_index"].to_pylist(), table["sample_index"].to_pylist()))


def damage_column(part: Path, column: str) -> None:
    """Overwrite one column's chunk (its pages) with 0xFF bytes: same size, footer intact."""
    group = pq.read_metadata(part).row_group(0)
    chunk = next(group.column(i) for i in range(group.num_columns) if group.column(i).path_in_schema == column)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(part.read_bytes())
    data[start:start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    part.write_bytes(bytes(data))
