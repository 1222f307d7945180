"""One stop policy through real `batchinfer run` processes: SIGTERM and SIGHUP wherever they land
(planning, inside a part's commit, at random), and a closed stdout, leave `_stats.json` counting
exactly the rows on disk, no lock or temporary behind, and a rerun that completes each (row, sample) once."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.job_process import REPO_ROOT, demo_cache, keys, read_parts, start_run, wait_for, write_demo_job  # noqa: F401

pytestmark = pytest.mark.slow  # processes on the demo model

ROWS = 6
DRIVER = Path(__file__).resolve().parents[2] / "signal_driver.py"


def small_job(folder: Path, n: int = 1) -> Path:
    """Every sample its own part (flush_rows 1): many commits for a signal to land in."""
    return write_demo_job(folder, ROWS, sampling={"max_tokens": 2, "ignore_eos": True, "n": n, "temperature": 0.8},
                          output={"path": "out/rag", "flush_rows": 1})


def start_driver(folder: Path, demo_cache: Path, when: str, count: int, signum: signal.Signals) -> subprocess.Popen:
    env = {**os.environ, "BATCHINFER_CACHE_DIR": str(demo_cache), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(DRIVER), when, str(count), signum.name], cwd=folder, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def check_stopped(process: subprocess.Popen, stderr: str, out_dir: Path, signum: signal.Signals) -> dict:
    """Exit 128 + signal, one error line, stats interrupted counting the rows on disk, nothing left over."""
    assert process.returncode == 128 + signum, stderr
    what = "interrupted" if signum == signal.SIGINT else f"terminated by {signum.name}"
    assert stderr.splitlines() == [f"error: job rag: {what} (finished parts are kept; rerun to resume)"], stderr
    stats = json.loads((out_dir / "_stats.json").read_text())
    assert stats["status"] == "interrupted" and stats["interrupted_by"] == signum.name
    on_disk = keys(read_parts(out_dir)) if any(out_dir.glob("part-*.parquet")) else []
    assert len(on_disk) == len(set(on_disk))
    assert stats["samples_resumed"] + stats["samples_written"] == len(on_disk), (stats, on_disk)
    assert not os.path.lexists(out_dir / "_lock.json")
    assert not [p.name for p in out_dir.iterdir() if p.name.endswith(".tmp")]
    return stats


def check_rerun_completes(folder: Path, demo_cache: Path, out_dir: Path, n: int = 1) -> None:
    rerun = start_run(folder, demo_cache)
    _, stderr = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, stderr
    assert keys(read_parts(out_dir)) == [(row, sample) for row in range(ROWS) for sample in range(n)]


@pytest.mark.parametrize("when, signum", [("write", signal.SIGTERM), ("renamed", signal.SIGTERM),
                                          ("write", signal.SIGHUP)], ids=["term-in-write", "term-after-rename",
                                                                          "hup-in-write"])
def test_a_signal_inside_a_commit_leaves_the_part_on_disk_and_counted(tmp_path, demo_cache, when, signum):
    out_dir = small_job(tmp_path)
    process = start_driver(tmp_path, demo_cache, when, 2, signum)
    _, stderr = process.communicate(timeout=600)
    check_stopped(process, stderr, out_dir, signum)
    assert (out_dir / (tmp_path / "signalled_part").read_text()).is_file()  # the part being committed is kept
    check_rerun_completes(tmp_path, demo_cache, out_dir)


def test_sigterm_while_planning_writes_interrupted_stats(tmp_path, demo_cache):
    out_dir = small_job(tmp_path)
    process = start_driver(tmp_path, demo_cache, "planning", 1, signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    stats = check_stopped(process, stderr, out_dir, signal.SIGTERM)
    assert stats["samples_written"] == 0
    check_rerun_completes(tmp_path, demo_cache, out_dir)


def test_signals_at_random_points_keep_stats_and_disk_equal_and_a_rerun_completes_once(tmp_path, demo_cache):
    out_dir = small_job(tmp_path, n=2)
    rng = random.Random(20240611)
    for trial in range(4):
        signum = (signal.SIGTERM, signal.SIGHUP)[trial % 2]
        process = start_run(tmp_path, demo_cache, stdout=subprocess.PIPE)
        for line in process.stdout:
            if "samples already done" in line:  # generation starts: parts commit from here on
                break
        time.sleep(rng.uniform(0.0, 4.0))
        process.send_signal(signum)
        process.stdout.close()
        _, stderr = process.communicate(timeout=600)
        if process.returncode == 0:  # finished before the signal
            break
        check_stopped(process, stderr, out_dir, signum)
    check_rerun_completes(tmp_path, demo_cache, out_dir, n=2)


def test_a_closed_stdout_silences_the_progress_and_the_run_completes(tmp_path, demo_cache):
    out_dir = small_job(tmp_path)
    process = start_run(tmp_path, demo_cache, stdout=subprocess.PIPE)  # as `batchinfer run jobs.yaml | head -1`
    process.stdout.readline()
    process.stdout.close()
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr
    assert stderr == "", stderr
    assert keys(read_parts(out_dir)) == [(row, 0) for row in range(ROWS)]
    assert json.loads((out_dir / "_stats.json").read_text())["status"] == "done"
