"""`batchinfer show OUT`: a job's summary from its output folder, finished or partial."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
from click.testing import CliRunner

import batchinfer
from batchinfer.cli import main

REPO = Path(__file__).resolve().parents[2]


def _finished_job(tmp_path: Path) -> Path:
    pq.write_table(pq.read_table(REPO / "examples" / "rag_demo.parquet").slice(0, 3), tmp_path / "rows.parquet")
    batchinfer.run({"jobs": [{"name": "rag", "model": "demo", "input": "rows.parquet",
                              "prompt": {"template": "{document}\nQuestion: {question}\nAnswer:"},
                              "sampling": {"max_tokens": 4}, "engine": {"device": "cpu"}, "output": "out/rag"}]},
                   base_dir=tmp_path, progress=False)
    return tmp_path / "out" / "rag"


def test_show_prints_a_finished_and_a_partial_folder(tmp_path):
    out = _finished_job(tmp_path)
    done = CliRunner().invoke(main, ["show", str(out)])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())  # rich wraps long lines at the terminal width
    assert "job rag: done" in text and "on disk: 3 samples in 1 parts of 3 input rows" in text
    assert "running:" not in text
    (out / "_stats.json").unlink()  # a run killed before it wrote its stats
    partial = CliRunner().invoke(main, ["show", str(out)])
    text = " ".join(partial.output.split())
    assert partial.exit_code == 0 and "no run has finished or stopped here yet" in text
    assert "on disk: 3 samples" in text


def test_show_names_a_live_run_holding_the_folder(tmp_path):
    out = _finished_job(tmp_path)
    from dataclasses import asdict

    from batchinfer.jobs.outdir.lock import LOCK_NAME, this_process
    holder = asdict(this_process())  # this process: alive
    (out / LOCK_NAME).write_text(json.dumps(holder))
    shown = CliRunner().invoke(main, ["show", str(out)])
    assert f"running: held by pid {os.getpid()}" in " ".join(shown.output.split())


def test_show_refuses_a_folder_that_is_not_an_output(tmp_path):
    shown = CliRunner().invoke(main, ["show", str(tmp_path)])
    assert shown.exit_code == 2 and shown.output.count("\n") == 1
    assert "not a batchinfer output folder" in shown.output
