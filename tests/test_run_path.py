"""The run path's single decisions: how many engines run a job's units (one worker layout for the
runner and the executors)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchinfer.jobs.run.parallel_run import runs_in_workers


def spec(device: str, workers, executor: str = "local") -> SimpleNamespace:
    return SimpleNamespace(engine=SimpleNamespace(device=device),
                           parallel=SimpleNamespace(workers=workers, executor=executor))


@pytest.mark.parametrize("device, workers, executor, gpus, expected", [
    ("cpu", "auto", "local", "0,1", False),     # auto on the CPU: one engine, here
    ("cpu", 2, "local", "", True),
    ("auto", "auto", "local", "", False),       # no GPU: the CPU, one engine
    ("auto", "auto", "local", "0,1", True),     # one engine per visible GPU
    ("cuda:1", "auto", "local", "0,1", False),  # a pinned GPU is one engine
    ("cuda", "auto", "local", "", False),       # no GPU for cuda: the engine here says so when it loads
    ("cuda", 2, "local", "", True),             # ... unless engines were asked for: the workers say so
    ("cpu", 1, "ray", "", True),
])
def test_the_runner_and_the_executors_count_workers_alike(monkeypatch, device, workers, executor, gpus, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus)
    assert runs_in_workers(spec(device, workers, executor)) is expected
