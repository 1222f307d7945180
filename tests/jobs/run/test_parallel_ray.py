"""The same real job with `executor: ray` on a local Ray cluster started here: the outputs of one engine.

The actors see this machine's filesystem, as every node of a real cluster must see the job file,
its inputs and the output folder at the same paths. Skipped only where Ray is not installed.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.jobs.run.test_parallel_run import DOCS, GREEDY, QUESTIONS, generations, one_engine, run  # noqa: F401 (fixture)
from tests.job_process import demo_cache  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # a local Ray cluster

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def uses_the_demo_cache(demo_cache) -> Path:  # noqa: F811 - the jobs below name model: demo
    return demo_cache


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    # Actors import batchinfer from this checkout and find the demo model where the tests put it.
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "BATCHINFER_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "demo-cache")}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield
    ray.shutdown()


def test_ray_cpu_actors_write_what_one_engine_writes(ray_cluster, one_engine, tmp_path):  # noqa: F811
    one_stats, one = one_engine(GREEDY)
    stats, out = run(tmp_path, GREEDY, executor="ray", workers=2)
    executor = stats["executor"]
    assert executor["executor"] == "ray" and executor["workers"] == 2 and executor["status"] == "done"
    assert sum(w["units"] for w in executor["per_worker"]) == stats["plan"]["units"] == 3
    assert generations(out) == generations(one) and len(generations(out)) == DOCS * QUESTIONS
    assert stats["cached_tokens"] == stats["plan"]["global_ideal_cached_tokens"] == one_stats["cached_tokens"]
