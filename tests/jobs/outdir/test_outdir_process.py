"""The output folder's life cycle through real `batchinfer run` processes: two runs on one folder,
SIGTERM, and damaged or foreign parts found by a rerun."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.job_process import (damage_column, demo_cache, keys, read_parts, run_in_this_process,  # noqa: F401
                               start_run, wait_for, write_demo_job)
from tests.jobs_fixtures import rag_table

pytestmark = pytest.mark.slow  # concurrent runs in subprocesses

BUSY_LINE = re.compile(r"^error: jobs\.yaml: jobs\.rag\.output: out/rag is in use by pid (\d+) on host (\S+) "
                       r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC; .+$")


def expected_files(out_dir) -> set[str]:
    """What a finished run leaves: parts, their records, manifest and stats; no lock, no temporaries."""
    parts = {p.name for p in out_dir.glob("part-*.parquet")}
    return parts | {f"_parts/{name}.json" for name in parts} | {"_parts", "_job.json", "_stats.json"}


def listing(out_dir) -> set[str]:
    return {str(p.relative_to(out_dir)) for p in out_dir.rglob("*")}


def check_busy_refusal(process: subprocess.Popen, stderr: str, holder: subprocess.Popen) -> None:
    assert process.returncode == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    match = BUSY_LINE.match(lines[0])
    assert match, lines[0]
    assert int(match.group(1)) == holder.pid and match.group(2) == socket.gethostname()


def test_two_runs_started_together_one_runs_the_other_exits_2_and_nothing_is_stored_twice(tmp_path, demo_cache):
    rows = 13
    out_dir = write_demo_job(tmp_path, rows, sampling={"max_tokens": 12, "ignore_eos": True})
    runs = [start_run(tmp_path, demo_cache), start_run(tmp_path, demo_cache)]
    results = [run.communicate() for run in runs]
    codes = sorted(run.returncode for run in runs)
    assert codes == [0, 2], results
    winner, loser = (runs[0], runs[1]) if runs[0].returncode == 0 else (runs[1], runs[0])
    check_busy_refusal(loser, results[runs.index(loser)][1], winner)
    assert keys(read_parts(out_dir)) == [(row, 0) for row in range(rows)]
    assert listing(out_dir) == expected_files(out_dir)
    stats = json.loads((out_dir / "_stats.json").read_text())
    assert stats["status"] == "done" and stats["samples_written"] == rows


def test_a_second_run_even_with_overwrite_leaves_a_busy_folder_alone(tmp_path, demo_cache):
    rows = 61
    # Row 0 has no prompt: its error row is the first part, on disk as soon as the engine starts;
    # the other rows decode long enough (20 rounds of 3 rows × 2,000 tokens; the run is interrupted)
    # for two more processes to start and be refused, also on a fast quiet machine with a fast model.
    out_dir = write_demo_job(tmp_path, rows, table=rag_table(rows, null_rows=(0,)),
                             sampling={"max_tokens": 2000, "ignore_eos": True},
                             output={"path": "out/rag", "flush_rows": 1})
    first = start_run(tmp_path, demo_cache)
    wait_for(lambda: bool(list(out_dir.glob("part-*.parquet"))), first)
    lock_text = (out_dir / "_lock.json").read_text()
    assert json.loads(lock_text)["pid"] == first.pid
    before = listing(out_dir)
    seconds = [start_run(tmp_path, demo_cache), start_run(tmp_path, demo_cache, "--overwrite")]
    for second in seconds:
        _, stderr = second.communicate()
        check_busy_refusal(second, stderr, first)
    assert first.poll() is None, "the first run ended before the others were refused"
    assert (out_dir / "_lock.json").read_text() == lock_text
    assert before <= listing(out_dir)  # nothing of the first run's was deleted
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate()
    assert first.returncode == 130, stderr
    done = keys(read_parts(out_dir))
    assert len(done) == len(set(done)) and (0, 0) in done
    # nothing left by the refused runs (the interrupted run keeps its plan, _work/, for the rerun)
    assert {name for name in listing(out_dir) if not name.startswith("_work")} == expected_files(out_dir)
    assert json.loads((out_dir / "_stats.json").read_text())["samples_written"] == len(done)


def test_sigterm_flushes_finished_samples_writes_stats_and_exits_143(tmp_path, demo_cache):
    rows, error_rows = 6, (0, 1, 2, 3)
    # The error rows finish the moment the engine pulls its first window; the other two decode 600 tokens
    # for a few seconds. No flush by count or time before the end: only the signal can save them.
    out_dir = write_demo_job(tmp_path, rows, table=rag_table(rows, null_rows=error_rows),
                             sampling={"max_tokens": 600, "ignore_eos": True},
                             engine={"max_running": 2, "device": "cpu"},
                             output={"path": "out/rag", "flush_rows": 1000})
    process = start_run(tmp_path, demo_cache, stdout=subprocess.PIPE)
    for line in process.stdout:
        if "samples already done" in line:
            break
    wait_for(lambda: False, process, seconds=0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate()
    assert process.returncode == 143, stderr
    assert stderr.splitlines() == ["error: job rag: terminated by SIGTERM (finished parts are kept; rerun to resume)"]
    on_disk = read_parts(out_dir)
    assert set(error_rows) <= set(on_disk["row_index"].to_pylist()) and on_disk.num_rows < rows
    stats = json.loads((out_dir / "_stats.json").read_text())
    assert stats["status"] == "interrupted" and stats["interrupted_by"] == "SIGTERM"
    assert stats["samples_written"] == on_disk.num_rows
    assert not (out_dir / "_lock.json").exists()

    rerun = start_run(tmp_path, demo_cache)
    _, stderr = rerun.communicate()
    assert rerun.returncode == 0, stderr
    assert keys(read_parts(out_dir)) == [(row, 0) for row in range(rows)]


def test_a_rerun_redoes_damaged_parts_and_ignores_a_users_own_part(tmp_path, demo_cache):
    rows = 9
    out_dir = write_demo_job(tmp_path, rows)
    first = run_in_this_process(tmp_path)
    assert first.exit_code == 0, (first.output, first.exception)
    reference = read_parts(out_dir)
    parts = sorted(out_dir.glob("part-*.parquet"))
    damaged_rows = {0: pq.read_metadata(parts[0]).num_rows, 1: pq.read_metadata(parts[1]).num_rows}
    damage_column(parts[0], "document")    # an input column: today's resume never reads it
    damage_column(parts[1], "row_index")
    foreign = out_dir / "part-00099.parquet"
    pq.write_table(pa.table({"mine": [1, 2, 3]}), foreign)
    foreign_bytes = foreign.read_bytes()

    rerun = start_run(tmp_path, demo_cache)
    _, stderr = rerun.communicate()
    assert rerun.returncode == 0, stderr
    lines = stderr.splitlines()
    assert len(lines) == 3 and "Traceback" not in stderr, stderr
    for index in damaged_rows:
        name = parts[index].name
        assert any(line.startswith(f"warning: out/rag/{name}: damaged") and f".{name}.damaged" in line
                   and "redone" in line for line in lines), (name, stderr)
        assert (out_dir / f".{name}.damaged").exists()
    assert any(line.startswith("warning: out/rag/part-00099.parquet: not written by batchinfer") for line in lines)
    assert foreign.read_bytes() == foreign_bytes  # never deleted, never counted
    foreign.unlink()
    out = pq.read_table(out_dir).sort_by([("row_index", "ascending"), ("sample_index", "ascending")])
    assert keys(out) == [(row, 0) for row in range(rows)]
    assert out["output_token_ids"].to_pylist() == reference["output_token_ids"].to_pylist()
    stats = json.loads((out_dir / "_stats.json").read_text())
    assert stats["samples_written"] == sum(damaged_rows.values())
    assert stats["samples_resumed"] == rows - sum(damaged_rows.values())
