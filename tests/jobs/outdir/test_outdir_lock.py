"""The output-folder lock: holder, heartbeat, stale locks taken over (once), busy folders refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from rich.console import Console

from batchinfer.jobs.errors import JobRuntimeError
from batchinfer.jobs.outdir.lock import LOCK_NAME, STALE_AFTER_SECONDS, LockLost, OutputBusy, OutputLock, this_process
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.cli_utils import invoke_cli
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def write_lock(folder: Path, age_seconds: float = 0.0, **fields) -> Path:
    """A lock file as another holder would have left it (default: this host, this process's identity)."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = replace(this_process(), **fields)
    path = folder / LOCK_NAME
    path.write_text(json.dumps(asdict(holder)))
    stamp = time.time() - age_seconds
    os.utime(path, (stamp, stamp))
    return path


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_lock_names_its_holder_and_goes_with_the_folder_it_created(tmp_path):
    folder = tmp_path / "out" / "rag"
    with OutputLock.acquire(folder, heartbeat_seconds=None) as lock:
        held = json.loads((folder / LOCK_NAME).read_text())
        assert held["pid"] == os.getpid() and held["host"] == lock.holder.host and held["token"] == lock.holder.token
        assert abs(held["started"] - time.time()) < 60
        with pytest.raises(OutputBusy, match=rf"^is in use by pid {os.getpid()} on host \S+ since \d{{4}}-"):
            OutputLock.acquire(folder, heartbeat_seconds=None)
    assert not (tmp_path / "out").exists()  # created for the run, left empty: removed again


def test_a_dead_process_lock_on_this_host_is_taken_over(tmp_path):
    write_lock(tmp_path, pid=dead_pid(), token="dead")
    with OutputLock.acquire(tmp_path, heartbeat_seconds=None) as lock:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.holder.token
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_reused_pid_is_not_its_old_holder(tmp_path):
    me = this_process()
    if me.pid_start is None:
        pytest.skip("no /proc: process start times unknown")
    write_lock(tmp_path, pid=os.getpid(), pid_start=me.pid_start - 1, token="earlier process with my pid")
    OutputLock.acquire(tmp_path, heartbeat_seconds=None).release()


def test_a_lock_from_another_host_is_stale_only_after_the_heartbeat_timeout(tmp_path):
    write_lock(tmp_path, age_seconds=30, host="elsewhere", pid=1, token="remote")
    with pytest.raises(OutputBusy, match=r"by pid 1 on host elsewhere .*last heartbeat \d+ s ago"):
        OutputLock.acquire(tmp_path, heartbeat_seconds=None)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "remote"
    write_lock(tmp_path, age_seconds=STALE_AFTER_SECONDS + 30, host="elsewhere", pid=1, token="remote")
    OutputLock.acquire(tmp_path, heartbeat_seconds=None).release()
    # Same hostname, another pid namespace (a container): judged by its heartbeat, not by a pid here.
    write_lock(tmp_path, age_seconds=30, pid=dead_pid(), pid_ns="pid:[1]", token="container")
    with pytest.raises(OutputBusy):
        OutputLock.acquire(tmp_path, heartbeat_seconds=None)


def test_an_unreadable_lock_is_busy_until_its_mtime_is_stale(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text("{half a lock")
    with pytest.raises(OutputBusy, match="cannot be read"):
        OutputLock.acquire(tmp_path, heartbeat_seconds=None)
    stamp = time.time() - STALE_AFTER_SECONDS - 30
    os.utime(path, (stamp, stamp))
    OutputLock.acquire(tmp_path, heartbeat_seconds=None).release()


def test_the_heartbeat_refreshes_the_mtime_and_notices_a_take_over(tmp_path):
    lock = OutputLock.acquire(tmp_path, heartbeat_seconds=0.02)
    path = tmp_path / LOCK_NAME
    os.utime(path, (1, 1))
    deadline = time.monotonic() + 10
    while path.stat().st_mtime < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.stat().st_mtime > time.time() - 60
    lock.ensure_held()
    write_lock(tmp_path, host="elsewhere", token="took it over")
    time.sleep(0.1)
    with pytest.raises(LockLost):
        lock.ensure_held()
    lock.release()
    assert json.loads(path.read_text())["token"] == "took it over"  # release leaves another's lock alone


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_never_releases_its_parents_lock(tmp_path):
    with OutputLock.acquire(tmp_path, heartbeat_seconds=None) as lock:
        child = os.fork()
        if child == 0:  # a worker inherits the lock object; releasing it there must leave the file alone
            try:
                lock.release()
            finally:
                os._exit(0)
        os.waitpid(child, 0)
        assert (tmp_path / LOCK_NAME).exists()
    assert not (tmp_path / LOCK_NAME).exists()


CONTENDER = """
import sys, time
from pathlib import Path
import batchinfer.jobs.outdir.lock as output_lock
from batchinfer.jobs.outdir.lock import OutputBusy, OutputLock
folder, go = Path(sys.argv[1]), Path(sys.argv[2])
judge = output_lock._is_stale
def judge_slowly(*args):  # every contender judges the dead lock stale before any of them acts on it
    verdict = judge(*args)
    time.sleep(0.3)
    return verdict
output_lock._is_stale = judge_slowly
while not go.exists():
    time.sleep(0.001)
try:
    lock = OutputLock.acquire(folder, heartbeat_seconds=None)
except OutputBusy:
    print("busy", flush=True)
    sys.exit(0)
print("won", flush=True)
while not (folder / "release").exists():
    time.sleep(0.01)
lock.release()
"""


@pytest.mark.slow
def test_contenders_for_a_stale_lock_take_it_over_exactly_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for round_ in range(3):
        folder = tmp_path / f"round{round_}"
        write_lock(folder, pid=dead_pid(), token="dead")
        go = tmp_path / f"go{round_}"
        contenders = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(folder), str(go)], env=env,
                                       stdout=subprocess.PIPE, text=True) for _ in range(4)]
        time.sleep(0.5)  # let them all start and wait for the go
        go.touch()
        outcomes = [process.stdout.readline().strip() for process in contenders]
        (folder / "release").touch()
        for process in contenders:
            assert process.wait(timeout=60) == 0
        assert sorted(outcomes) == ["busy", "busy", "busy", "won"], outcomes


def make_job(folder: Path, checkpoint: Path) -> Path:
    write_parquet(rag_table(5), folder / "data" / "rag.parquet")
    return write_job_file(folder, [job_entry(model=str(checkpoint))])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("args", [(), ("--overwrite",)])
def test_a_busy_folder_is_one_line_exit_2_and_nothing_written(tmp_path, checkpoint, args):
    make_job(tmp_path, checkpoint)
    (tmp_path / "out" / "rag").mkdir(parents=True)
    (tmp_path / "out" / "rag" / "part-00000.parquet").write_bytes(b"someone's")
    with OutputLock.acquire(tmp_path / "out" / "rag", heartbeat_seconds=None):
        before = snapshot(tmp_path)
        result = invoke_cli(tmp_path, "run", "jobs.yaml", *args)
        assert result.exit_code == 2, (result.output, result.exception)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"error: jobs.yaml: jobs.rag.output: out/rag is in use by pid {os.getpid()} on host "), result.stderr
        assert snapshot(tmp_path) == before


def test_a_run_whose_lock_was_taken_over_stops_before_writing(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint)
    job = prepare_job(load_job_file(job_file).jobs[0])
    lock = OutputLock.acquire(job.spec.output.path, heartbeat_seconds=None)
    write_lock(job.spec.output.path, host="elsewhere", token="took it over")
    lock.beat()
    with pytest.raises(JobRuntimeError, match="taken over by another run"):
        run_job(job, Console(quiet=True), engine_factory=lambda *_: FakeEngine(), lock=lock)
    assert {p.name for p in job.spec.output.path.iterdir()} == {LOCK_NAME}  # nothing written: no part, no stats
    lock.release()
