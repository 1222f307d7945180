"""End to end on the real engine with the demo model: run, plan, and resume after kill -9."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from batchinfer.jobs.outdir.part_writer import RESULT_COLUMNS
from tests.cli_utils import invoke_cli
from tests.job_process import demo_cache, read_parts, start_run, wait_for, write_demo_job  # noqa: F401 (fixture)
from tests.jobs_fixtures import job_entry, rag_table, write_job_file, write_parquet


@pytest.fixture(autouse=True)
def uses_the_demo_cache(demo_cache) -> Path:  # noqa: F811 - every test here runs the demo model
    return demo_cache


def test_run_and_plan_a_chat_job_with_samples_and_a_bad_row(tmp_path):
    rows = 7
    table = rag_table(rows, null_rows=(4,))
    write_parquet(table, tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(
        model="demo", chat=True, system="Answer briefly.", id_column="qid",
        sampling={"max_tokens": 5, "n": 2, "temperature": 0.8, "top_k": 50, "seed": 3},
        engine={"max_running": 8, "max_model_len": 512})])

    plan = invoke_cli(tmp_path, "plan", "jobs.yaml")
    assert plan.exit_code == 0, plan.output
    assert not (tmp_path / "out").exists()  # planning writes nothing

    result = invoke_cli(tmp_path, "run", "jobs.yaml")
    assert result.exit_code == 0, (result.output, result.exception)
    out = read_parts(tmp_path / "out" / "rag")
    assert out.column_names == table.column_names + list(RESULT_COLUMNS)
    assert out.num_rows == rows * 2
    assert list(zip(out["row_index"].to_pylist(), out["sample_index"].to_pylist())) == \
        [(r, s) for r in range(rows) for s in range(2)]
    assert out["qid"].to_pylist() == [q for q in table["qid"].to_pylist() for _ in range(2)]
    for row in out.to_pylist():
        if row["row_index"] == 4:
            assert row["finish_reason"] == "error" and row["error"] == "template column 'document' is null"
        else:
            assert row["error"] is None and row["finish_reason"] in ("stop", "length")
            assert 1 <= row["completion_tokens"] == len(row["output_token_ids"]) <= 5
            assert row["prompt_tokens"] > 20
    stats = json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())
    assert stats["status"] == "done" and stats["errors"] == 2 and stats["rows"] == rows
    assert stats["requests"] == (rows - 1) * 2
    assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in out.to_pylist())
    assert stats["output_tokens"] == sum(out["completion_tokens"].to_pylist())
    # Same prompt twice (n=2) and shared document prefixes: the cache must have been hit.
    assert stats["cached_tokens"] > 0 and stats["planned_cached_tokens"] > 0
    assert f"{stats['plan']['global_ideal_cached_tokens']:,}" in plan.output


def _start_job_and_signal_after_first_part(tmp_path: Path, demo_cache: Path, rows: int, sig: int):
    """Run a CPU job as a real process; send `sig` once its first part is on disk.
    → (returncode, stderr, out_dir)."""
    # Three sequences at a time, flushed as each wave finishes: parts appear well before the end.
    out_dir = write_demo_job(tmp_path, rows)
    process = start_run(tmp_path, demo_cache)
    wait_for(lambda: bool(list(out_dir.glob("part-*.parquet"))), process)
    process.send_signal(sig)
    _, stderr = process.communicate()
    return process.returncode, stderr, out_dir


@pytest.mark.slow
def test_ctrl_c_keeps_finished_parts_exits_130_and_a_rerun_completes(tmp_path, demo_cache):
    rows = 13
    code, stderr, out_dir = _start_job_and_signal_after_first_part(tmp_path, demo_cache, rows, signal.SIGINT)
    assert code == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert json.loads((out_dir / "_stats.json").read_text())["status"] == "interrupted"
    assert not [p for p in out_dir.iterdir() if p.name.endswith(".tmp")]
    done_before = read_parts(out_dir).num_rows
    assert 0 < done_before < rows

    result = invoke_cli(tmp_path, "run", "jobs.yaml")
    assert result.exit_code == 0, (result.output, result.exception)
    out = read_parts(out_dir)
    assert out["row_index"].to_pylist() == list(range(rows))


def test_resume_after_kill_9_holds_every_row_and_sample_exactly_once(tmp_path, demo_cache):
    rows = 13
    code, stderr, out_dir = _start_job_and_signal_after_first_part(tmp_path, demo_cache, rows, signal.SIGKILL)
    assert code == -signal.SIGKILL, stderr  # killed mid-job, not finished
    assert (out_dir / "_lock.json").is_file()  # left behind by the dead run: the rerun takes it over
    before = {p.name: p.read_bytes() for p in out_dir.glob("part-*.parquet")}
    done_before = read_parts(out_dir).num_rows
    assert 0 < done_before < rows

    result = invoke_cli(tmp_path, "run", "jobs.yaml")
    assert result.exit_code == 0, (result.output, result.exception)
    out = read_parts(out_dir)
    assert out["row_index"].to_pylist() == list(range(rows)) and set(out["sample_index"].to_pylist()) == {0}
    assert all(n == 6 for n in out["completion_tokens"].to_pylist())
    assert {name: (out_dir / name).read_bytes() for name in before} == before  # never rewritten
    assert not [p for p in out_dir.iterdir() if p.name.endswith(".tmp")] and not (out_dir / "_lock.json").exists()
    stats = json.loads((out_dir / "_stats.json").read_text())
    assert stats["samples_resumed"] == done_before and stats["samples_written"] == rows - done_before
