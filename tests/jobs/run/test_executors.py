"""The executor layer with fake workers: queue order, retries, restarts, balance, placement, accounting.

Process tests spawn real worker processes running `test_executors_fakes.FakeUnitWorker`.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from batchinfer.jobs.run.executors import (LocalExecutor, ProgressDelta, RateLimitedSink, RetryPolicy, UnitResult, UnitSpec,
                            executor_problem, local_placements, predict_balance, resolve_workers, visible_gpus)
from batchinfer.jobs.run.executors.tally import Tally
from batchinfer.jobs.run.executors.unit_queue import UnitQueue
from tests.conftest import requires_cuda
from tests.jobs.run.test_executors_fakes import committed_rows, opened_workers, read_attempts, write_fake_job

UNIT_ROWS = {0: 3, 1: 5, 2: 2, 3: 6, 4: 4, 5: 1, 6: 5, 7: 3}


def _specs(unit_rows: dict[int, int]) -> list[UnitSpec]:
    return [UnitSpec(unit, cost=float(rows), samples=rows) for unit, rows in unit_rows.items()]


def _expected_rows(unit_rows: dict[int, int]) -> list[tuple[int, int]]:
    return sorted((unit, row) for unit, rows in unit_rows.items() for row in range(rows))


def _run(folder: Path, workers: int, unit_rows=UNIT_ROWS, policy=RetryPolicy(), specs=None, **settings):
    recipe = write_fake_job(folder, unit_rows, **settings)
    report = LocalExecutor(recipe, local_placements(workers, "cpu", cores=2), policy).run(
        specs if specs is not None else _specs(unit_rows))
    assert multiprocessing.active_children() == []  # every worker process was reaped
    return report


# --- pure parts -----------------------------------------------------------------------------------

def test_queue_hands_out_largest_cost_first_and_requeues_until_the_attempt_limit():
    queue = UnitQueue([UnitSpec(0, 1.0), UnitSpec(1, 5.0), UnitSpec(2, 3.0), UnitSpec(3, 5.0)], max_attempts=2)
    assert [queue.take() for _ in range(2)] == [1, 3]  # equal costs: lower id first
    assert queue.fail(1, "boom") is True
    assert queue.take() == 1                             # back in cost order, ahead of 2
    assert queue.fail(1, "boom again") is False          # second attempt used up
    assert [queue.take(), queue.take(), queue.take()] == [2, 0, None]
    assert queue.retried == [1] and queue.unfinished == 3


def test_predict_balance_is_lpt():
    balance = predict_balance([3, 5, 3, 4, 3], workers=2)
    # 5 -> w0, 4 -> w1, 3 (first) -> w1 (7), 3 -> w0 (8), 3 -> w1 (10)
    assert balance.assignment == (1, 0, 0, 1, 1)
    assert balance.loads == (8.0, 10.0) and balance.unit_counts == (2, 3)
    assert (balance.makespan, balance.ideal, balance.total) == (10.0, 9.0, 18.0)
    assert balance.overhead == pytest.approx(1 / 9)
    assert predict_balance([10, 1, 1], workers=2).overhead == 0.0  # the largest unit bounds the ideal
    assert predict_balance([], workers=3).loads == (0.0, 0.0, 0.0)


def test_rate_limited_sink_bounds_messages_and_drops_a_finished_units_leftover():
    now = [0.0]
    sent = []
    sink = RateLimitedSink(lambda unit, delta: sent.append((unit, delta.samples)), interval=1.0, clock=lambda: now[0])
    for step in range(10):  # 10 reports over 0.9 s: nothing yet
        now[0] = step * 0.1
        sink.report(7, ProgressDelta(samples=1))
    now[0] = 1.0
    sink.report(7, ProgressDelta(samples=1))
    assert sent == [(7, 11)]
    sink.report(7, ProgressDelta(samples=2))
    sink.discard(7)
    now[0] = 5.0
    sink.report(8, ProgressDelta(samples=1))
    assert sent == [(7, 11), (8, 1)]


def test_tally_replaces_live_counts_by_the_result_and_drops_a_dead_workers_counts():
    now = [0.0]
    tally = Tally({0: UnitSpec(0, 1.0, samples=4), 1: UnitSpec(1, 1.0, samples=4)}, ["cpu", "cpu"],
                  clock=lambda: now[0])
    for slot, unit in ((0, 0), (1, 1)):
        tally.worker_starting(slot, restart=False)
        tally.worker_ready(slot)
        tally.unit_started(slot, unit)
    tally.progress(0, ProgressDelta(samples=2, prompt_tokens=20, cached_tokens=10))
    tally.progress(1, ProgressDelta(samples=3, prompt_tokens=30))
    now[0] = 6.0
    assert tally.snapshot().samples_done == 5
    tally.worker_died(1, [1], "killed")
    tally.unit_finished(0, UnitResult(0, samples_written=3, samples_skipped=1, prompt_tokens=40, cached_tokens=20))
    snap = tally.snapshot()
    assert (snap.samples_done, snap.prompt_tokens, snap.hit_rate) == (4, 40, 0.5)
    assert snap.eta_seconds == pytest.approx(8.0)  # 3 of this run's 7 samples in 6 s (1 was skipped)
    tally.progress(1, ProgressDelta(samples=9))     # late event of the lost unit: ignored
    assert tally.snapshot().samples_done == 4
    stats = tally.stats("local", "done", None, [])
    assert stats["per_worker"][1]["failures"] == ["killed"] and stats["per_worker"][0]["busy_seconds"] == 6.0


def test_placements_split_cores_and_a_shared_gpus_memory():
    cpu = local_placements(2, "cpu", cores=9)
    assert [p.torch_threads for p in cpu] == [4, 4] and cpu[0].env["OMP_NUM_THREADS"] == "4"
    shared = local_placements(2, "cuda", gpus=["3"], memory_fraction=0.9)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in shared] == ["3", "3"]
    assert [p.overrides["engine.memory_fraction"] for p in shared] == [0.45, 0.45]
    spread = local_placements(2, "cuda", gpus=["0", "1"])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in spread] == ["0", "1"] and spread[0].overrides == {}
    assert resolve_workers("auto", "cuda", 8) == 8 and resolve_workers("auto", "cpu", 0) == 1
    with pytest.raises(ValueError):
        local_placements(1, "cuda", gpus=[])


def test_importing_the_package_does_not_import_ray_and_a_missing_ray_is_one_line(monkeypatch):
    code = "import sys, batchinfer.jobs.run.executors; assert 'ray' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    import batchinfer.jobs.spec.executors as executor_names
    monkeypatch.setattr(executor_names.importlib.util, "find_spec", lambda name: None)
    assert executor_problem("ray") == "executor: ray needs Ray, which is not installed (pip install 'batchinfer[ray]')"
    assert executor_problem("local") is None
    assert "unknown executor" in executor_problem("slurm")


# --- worker processes ------------------------------------------------------------------------------

def test_two_workers_commit_the_same_outputs_as_one(tmp_path):
    one = _run(tmp_path / "one", 1, sleep=0.01)
    two = _run(tmp_path / "two", 2, sleep=0.01, open_barrier=2)
    for report, folder in ((one, tmp_path / "one"), (two, tmp_path / "two")):
        assert report.status == "done" and report.failure is None
        assert sorted(committed_rows(folder)) == _expected_rows(UNIT_ROWS)
        assert Counter(unit for _, unit in read_attempts(folder)) == Counter(UNIT_ROWS.keys())  # each unit once
    stats = two.stats
    assert stats["samples_written"] == sum(UNIT_ROWS.values()) and stats["cache_hit_rate"] == pytest.approx(0.4)
    assert sum(w["units"] for w in stats["per_worker"]) == len(UNIT_ROWS)
    assert all(w["units"] > 0 and w["busy_seconds"] > 0 for w in stats["per_worker"])
    assert stats["counters"] == {"states_evicted": len(UNIT_ROWS), "peak_memory_bytes": 107}  # summed; peak maxed
    assert max(w["peak_memory_bytes"] for w in stats["per_worker"]) == 107  # each worker's own peak too


def test_one_worker_runs_units_largest_estimated_cost_first(tmp_path):
    costs = {0: 2.0, 1: 9.0, 2: 4.0, 3: 7.0, 4: 4.0}
    recipe = write_fake_job(tmp_path, {unit: 1 for unit in costs})
    report = LocalExecutor(recipe, local_placements(1, "cpu", cores=2)).run(
        [UnitSpec(unit, cost) for unit, cost in costs.items()])
    assert report.status == "done"
    assert [unit for _, unit in read_attempts(tmp_path)] == [1, 3, 2, 4, 0]


def test_a_free_worker_takes_the_next_unit_instead_of_a_static_share(tmp_path):
    unit_rows = {0: 24, 1: 2, 2: 2, 3: 2, 4: 2}  # unit 0: 12 chunks; the others one chunk each
    report = _run(tmp_path, 2, unit_rows, sleep=0.1)
    assert report.status == "done"
    attempts = read_attempts(tmp_path)
    big_worker = next(worker for worker, unit in attempts if unit == 0)
    assert [unit for worker, unit in attempts if worker == big_worker] == [0]


def test_sigkill_of_a_worker_mid_unit_still_commits_every_row_exactly_once(tmp_path):
    report = _run(tmp_path, 2, kill_once=[3], sleep=0.02)
    assert report.status == "done", report.failure
    assert sorted(committed_rows(tmp_path)) == _expected_rows(UNIT_ROWS)  # no row twice, none missing
    attempts = Counter(unit for _, unit in read_attempts(tmp_path))
    assert attempts[3] == 2 and all(attempts[unit] == 1 for unit in UNIT_ROWS if unit != 3)
    assert report.results[3].samples_skipped == 2   # the first chunk, committed before the kill, was kept
    assert report.stats["units_retried"] == [3]
    assert sum(w["restarts"] for w in report.stats["per_worker"]) == 1
    assert any("killed by SIGKILL while running unit 3" in f for w in report.stats["per_worker"] for f in w["failures"])


def test_a_unit_that_kills_every_worker_ends_the_job_naming_it(tmp_path):
    # Unit 3 is handed out last (cheapest), so other units are in flight whenever it kills a worker.
    specs = [UnitSpec(unit, cost=0.5 if unit == 3 else float(rows), samples=rows) for unit, rows in UNIT_ROWS.items()]
    report = _run(tmp_path, 2, policy=RetryPolicy(max_unit_attempts=3, max_restarts_per_worker=5), specs=specs,
                  always_kill=[3])
    assert report.status == "failed"
    assert report.failure.startswith("unit 3 failed on all 3 attempts")
    assert "killed by SIGKILL" in report.failure
    assert Counter(unit for _, unit in read_attempts(tmp_path))[3] == 3
    finished = set(report.results)
    assert 3 not in finished and finished  # other units finished meanwhile, and their rows are kept
    rows = committed_rows(tmp_path)
    assert len(rows) == len(set(rows))
    assert {(u, r) for u, r in rows if u != 3} == {(u, r) for u, r in _expected_rows(UNIT_ROWS) if u in finished}


def test_a_unit_that_raises_ends_the_job_with_its_exception(tmp_path):
    report = _run(tmp_path, 1, policy=RetryPolicy(max_unit_attempts=2), raise_in=[6])
    assert report.status == "failed"
    assert report.failure.startswith("unit 6 failed on all 2 attempts")
    assert "raised RuntimeError: fake failure in unit 6 while running unit 6" in report.failure


def test_every_worker_failing_ends_the_job_with_the_reasons(tmp_path):
    report = _run(tmp_path, 2, policy=RetryPolicy(max_restarts_per_worker=1), fail_open=True)
    assert report.status == "failed"
    assert report.failure.startswith("every worker failed (worker 0: ")
    assert "RuntimeError: cannot load the fake model on cpu before it was ready" in report.failure
    assert [w["restarts"] for w in report.stats["per_worker"]] == [1, 1]
    assert committed_rows(tmp_path) == []


def test_sigterm_in_the_parent_stops_handing_out_units_and_terminates_workers(tmp_path):
    recipe = write_fake_job(tmp_path, UNIT_ROWS, sleep=0.2)
    previous = signal.getsignal(signal.SIGTERM)
    snapshots = []

    def on_progress(snapshot):
        snapshots.append(snapshot)
        if snapshot.units_finished >= 1 and not executor.stop_flag:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the executor: sets its stop flag

    executor = LocalExecutor(recipe, local_placements(2, "cpu", cores=2), progress_interval=0.05,
                             on_progress=on_progress)
    report = executor.run(_specs(UNIT_ROWS))
    assert report.status == "interrupted" and report.stats["status"] == "interrupted"
    assert 1 <= len(report.results) < len(UNIT_ROWS)
    assert multiprocessing.active_children() == []
    assert signal.getsignal(signal.SIGTERM) is previous  # the parent's own handler is back
    assert any(s.samples_done > 0 and s.output_tokens_per_second > 0 for s in snapshots)


def test_workers_sharing_one_gpu_get_its_id_and_half_the_memory(tmp_path):
    # The fake never touches CUDA: this checks what a CUDA worker is told, end to end through spawn.
    recipe = write_fake_job(tmp_path, {0: 1, 1: 1})
    report = LocalExecutor(recipe, local_placements(2, "cuda", gpus=["5"], memory_fraction=0.8)).run(
        _specs({0: 1, 1: 1}))
    assert report.status == "done"
    seen = opened_workers(tmp_path)
    assert sorted(s["worker"] for s in seen) == [0, 1]
    assert all(s["device"] == "cuda:0" and s["env"]["CUDA_VISIBLE_DEVICES"] == "5" for s in seen)
    assert all(s["overrides"] == {"engine.memory_fraction": 0.4} for s in seen)
    assert [w["device"] for w in report.stats["per_worker"]] == ["gpu 5", "gpu 5"]
    cpu_folder = tmp_path / "cpu"
    _run(cpu_folder, 2, {0: 1, 1: 1})
    assert {s["env"]["OMP_NUM_THREADS"] for s in opened_workers(cpu_folder)} == {"1"}


@requires_cuda
@pytest.mark.gpu
def test_two_cuda_workers_on_one_gpu_each_see_one_device_and_survive_a_sigkill(tmp_path):
    recipe = write_fake_job(tmp_path, UNIT_ROWS, cuda=True, kill_once=[3])
    placements = local_placements(2, "cuda", gpus=visible_gpus()[:1], memory_fraction=0.9)
    report = LocalExecutor(recipe, placements).run(_specs(UNIT_ROWS))
    assert report.status == "done", report.failure
    assert sorted(committed_rows(tmp_path)) == _expected_rows(UNIT_ROWS)
    seen = opened_workers(tmp_path)
    assert len(seen) == 3  # two workers and the one restarted after the kill
    assert all(s["cuda_device_count"] == 1 and s["overrides"] == {"engine.memory_fraction": 0.45} for s in seen)


# --- workers whose engine overlaps units (run_units) ----------------------------------------------

def test_a_streaming_worker_holds_the_next_unit_while_the_first_still_runs(tmp_path):
    unit_rows = {0: 8, 1: 2}  # unit 0 handed out first (larger); unit 1 joins it and finishes first
    plain = _run(tmp_path / "plain", 1, unit_rows)
    streaming = _run(tmp_path / "streaming", 1, unit_rows, streaming=True)
    assert list(plain.results) == [0, 1]
    assert list(streaming.results) == [1, 0]       # finish order: the two units overlapped
    for report, folder in ((plain, tmp_path / "plain"), (streaming, tmp_path / "streaming")):
        assert report.status == "done" and sorted(committed_rows(folder)) == _expected_rows(unit_rows)
    worker = streaming.stats["per_worker"][0]
    assert worker["units"] == 2 and 0 < worker["busy_seconds"] <= streaming.stats["wall_seconds"]


def test_sigkill_of_a_streaming_worker_requeues_every_unit_it_held_and_commits_each_row_once(tmp_path):
    report = _run(tmp_path, 2, kill_once=[3], sleep=0.02, streaming=True)
    assert report.status == "done", report.failure
    assert sorted(committed_rows(tmp_path)) == _expected_rows(UNIT_ROWS)  # no row twice, none missing
    attempts = Counter(unit for _, unit in read_attempts(tmp_path))
    assert attempts[3] == 2 and 3 in report.stats["units_retried"]
    died = [f for w in report.stats["per_worker"] for f in w["failures"]]
    assert len(died) == 1 and "killed by SIGKILL while running unit" in died[0]
    held = [int(u) for u in died[0].split("while running unit")[1].lstrip("s ").split(", ")]
    assert 3 in held and all(attempts[unit] == 2 for unit in held)   # everything it held ran again
    assert report.stats["units_retried"] == sorted(held)
