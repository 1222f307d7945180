"""Workers of a `--workers 2` run die with their parent: after `kill -9` of the run, none lives on
to commit parts into a folder whose lock already counts as stale."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.job_process import demo_cache, start_run, wait_for, write_demo_job  # noqa: F401
from tests.jobs_fixtures import rag_table

pytestmark = pytest.mark.slow  # three processes on the demo model


def worker_pids(parent: int) -> list[int]:
    """The multiprocessing-spawned children of `parent` (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == parent and "spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")
def test_workers_die_with_their_parent_and_commit_nothing_after_it(tmp_path, demo_cache):
    # The error rows' parts appear at once; the other rows then decode for minutes, so a worker that
    # outlives its parent is found alive (it would notice only at its next message to the parent).
    out_dir = write_demo_job(tmp_path, 12, table=rag_table(12, null_rows=(0, 1, 2, 3, 4, 5)),
                             sampling={"max_tokens": 1000, "ignore_eos": True},
                             output={"path": "out/rag", "flush_rows": 1}, parallel={"workers": 2})
    parent = start_run(tmp_path, demo_cache)
    wait_for(lambda: any(out_dir.glob("part-u*.parquet")), parent, seconds=600)  # a worker is committing
    workers = worker_pids(parent.pid)
    assert parent.poll() is None and len(workers) == 2, parent.communicate()[1] if parent.poll() else workers
    parent.kill()
    parent.wait()  # not communicate(): the workers hold its stderr pipe open while they live
    killed = time.time()
    time.sleep(3.0)
    alive = [pid for pid in workers if running(pid)]
    late = [p.name for p in out_dir.glob("part-*.parquet") if p.stat().st_mtime > killed + 0.5]
    for pid in alive:  # the old behaviour: orphans run on; end them here
        os.kill(pid, signal.SIGKILL)
    parent.stderr.close()
    assert alive == [] and late == []
