"""The Ray executor on a local Ray cluster started here: same outputs and the same recovery as local.

Skipped only where Ray is not installed (`pip install -e '.[ray]'`).
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from batchinfer.jobs.run.executors import RayExecutor, RetryPolicy, UnitSpec
from tests.jobs.run.test_executors_fakes import committed_rows, opened_workers, read_attempts, write_fake_job

pytestmark = pytest.mark.slow  # a local Ray cluster

ray = pytest.importorskip("ray")

UNIT_ROWS = {0: 3, 1: 5, 2: 2, 3: 6, 4: 4, 5: 1}
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ray_cluster():
    # Actors import the fake worker by module path: give them this checkout on sys.path.
    # Two logical GPUs: Ray schedules num_gpus actors and sets CUDA_VISIBLE_DEVICES; the fake never uses CUDA.
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}})
    yield
    ray.shutdown()


def _specs() -> list[UnitSpec]:
    return [UnitSpec(unit, cost=float(rows), samples=rows) for unit, rows in UNIT_ROWS.items()]


def _expected() -> list[tuple[int, int]]:
    return sorted((unit, row) for unit, rows in UNIT_ROWS.items() for row in range(rows))


def test_two_cpu_actors_commit_every_row_once_also_when_one_is_killed(ray_cluster, tmp_path):
    recipe = write_fake_job(tmp_path, UNIT_ROWS, sleep=0.02, kill_once=[3])
    report = RayExecutor(recipe, workers=2, device="cpu", address="local").run(_specs())
    assert report.status == "done", report.failure
    assert sorted(committed_rows(tmp_path)) == _expected()
    attempts = Counter(unit for _, unit in read_attempts(tmp_path))
    assert attempts[3] == 2 and all(attempts[unit] == 1 for unit in UNIT_ROWS if unit != 3)
    assert report.results[3].samples_skipped == 2
    stats = report.stats
    assert stats["executor"] == "ray" and stats["units_retried"] == [3]
    assert sum(w["units"] for w in stats["per_worker"]) == len(UNIT_ROWS)
    assert any("while running unit 3" in f for w in stats["per_worker"] for f in w["failures"])
    assert {s["device"] for s in opened_workers(tmp_path)} == {"cpu"}


def test_streaming_actors_overlap_units_and_a_killed_one_gives_back_all_it_held(ray_cluster, tmp_path):
    recipe = write_fake_job(tmp_path, UNIT_ROWS, sleep=0.02, kill_once=[3], streaming=True)
    report = RayExecutor(recipe, workers=2, device="cpu").run(_specs())
    assert report.status == "done", report.failure
    assert sorted(committed_rows(tmp_path)) == _expected()
    died = [f for w in report.stats["per_worker"] for f in w["failures"]]
    assert len(died) == 1 and "(Ray actor) died while running unit" in died[0]
    assert 3 in report.stats["units_retried"]


def test_more_workers_than_the_cluster_holds_is_refused_instead_of_waiting_forever(ray_cluster, tmp_path):
    recipe = write_fake_job(tmp_path, {0: 1})
    with pytest.raises(RuntimeError, match="3 Ray workers need 3 CPUs, the cluster has 2"):
        RayExecutor(recipe, workers=3, device="cpu").run([UnitSpec(0, 1.0)])
    with pytest.raises(RuntimeError, match="3 Ray workers need 3 GPUs, the cluster has 2"):
        RayExecutor(recipe, workers=3, device="cuda").run([UnitSpec(0, 1.0)])


def test_a_unit_that_raises_on_every_actor_ends_the_job_naming_it(ray_cluster, tmp_path):
    recipe = write_fake_job(tmp_path, {0: 1, 1: 1}, raise_in=[1])
    report = RayExecutor(recipe, workers=1, device="cpu", policy=RetryPolicy(max_unit_attempts=2)).run(
        [UnitSpec(0, 1.0), UnitSpec(1, 2.0)])
    assert report.status == "failed"
    assert report.failure.startswith("unit 1 failed on all 2 attempts")
    assert "raised RuntimeError: fake failure in unit 1 while running unit 1" in report.failure


def test_cuda_actors_get_one_gpu_each_and_share_the_memory_when_they_share_a_gpu(ray_cluster, tmp_path):
    whole = tmp_path / "whole"
    report = RayExecutor(write_fake_job(whole, UNIT_ROWS), workers="auto", device="cuda").run(_specs())
    assert report.status == "done" and sorted(committed_rows(whole)) == _expected()
    seen = opened_workers(whole)
    assert len(seen) == 2 and {s["env"]["CUDA_VISIBLE_DEVICES"] for s in seen} == {"0", "1"}
    assert all(s["device"] == "cuda:0" and s["overrides"] == {} for s in seen)
    half = tmp_path / "half"
    report = RayExecutor(write_fake_job(half, {0: 1, 1: 1}), workers=2, device="cuda", gpus_per_worker=0.5,
                         memory_fraction=0.9).run([UnitSpec(0, 1.0), UnitSpec(1, 1.0)])
    assert report.status == "done"
    assert [s["overrides"] for s in opened_workers(half)] == [{"engine.memory_fraction": 0.45}] * 2
