"""A full disk (ENOSPC, EDQUOT) during `batchinfer run`: one line, exit 1, finished parts kept, and a
rerun completes each (row, sample) once; wherever it strikes: parts, stats, the planning's TMPDIR."""
from __future__ import annotations

import errno
import json
import re

import pytest

import batchinfer.jobs.outdir.atomic_files as atomic_files
import batchinfer.jobs.run.global_run as global_run
import batchinfer.jobs.outdir.part_store as part_store
from tests.job_process import demo_cache, keys, read_parts, run_in_this_process, write_demo_job  # noqa: F401

pytestmark = pytest.mark.slow  # the demo model, in this process
ROWS = 6
LINE = re.compile(r"^error: job rag: no space left on device: (.+); finished parts kept, rerun to resume$")


class DiskFillsAfter:
    """fsync_file: fine `calls` times, then the disk is full for every durable write (parts, records, stats)."""

    def __init__(self, fsync, calls: int, code: int) -> None:
        self.fsync, self.left, self.code = fsync, calls, code

    def __call__(self, path) -> None:
        if self.left == 0:
            raise OSError(self.code, "No space left on device")
        self.left -= 1
        self.fsync(path)


def job(folder):
    return write_demo_job(folder, ROWS, sampling={"max_tokens": 2, "ignore_eos": True},
                          output={"path": "out/rag", "flush_rows": 1})


def check_one_line(result) -> str:
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert "Traceback" not in result.output
    match = LINE.match(result.stderr.splitlines()[-1])
    assert match, result.stderr
    return match.group(1)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_disk_that_fills_mid_run_is_one_line_and_a_rerun_completes(tmp_path, demo_cache, monkeypatch, code):
    out_dir = job(tmp_path)
    full = DiskFillsAfter(atomic_files.fsync_file, calls=12, code=code)  # the plan, the manifest, some parts
    monkeypatch.setattr(part_store, "fsync_file", full)
    monkeypatch.setattr(atomic_files, "fsync_file", full)
    path = check_one_line(run_in_this_process(tmp_path))
    assert path.startswith("out/rag"), path  # the part whose write failed, or the folder when no file is named
    assert 0 < len(keys(read_parts(out_dir))) < ROWS
    assert not [p for p in out_dir.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    result = run_in_this_process(tmp_path)
    assert result.exit_code == 0, (result.output, result.exception)
    assert keys(read_parts(out_dir)) == [(row, 0) for row in range(ROWS)]
    assert json.loads((out_dir / "_stats.json").read_text())["samples_resumed"] > 0


def test_a_full_tmpdir_while_planning_is_one_line_naming_the_file(tmp_path, demo_cache, monkeypatch):
    job(tmp_path)
    scratch = tmp_path / "tmp" / "batchinfer-cut-1" / "run-0.npy"

    def planning_on_a_full_tmpdir(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(scratch))  # as the sort's scratch write fails
    monkeypatch.setattr(global_run, "build_work_plan", planning_on_a_full_tmpdir)
    assert check_one_line(run_in_this_process(tmp_path)) == str(scratch.relative_to(tmp_path))
    monkeypatch.undo()
    result = run_in_this_process(tmp_path)
    assert result.exit_code == 0, (result.output, result.exception)
