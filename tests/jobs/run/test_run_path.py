"""The run path's single decisions: how many engines run a job's units (one worker layout for the
runner and the executors)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchinfer.jobs.run.parallel_run import runs_in_workers


def spec(device: str, workers, executor: str = "local", stages: int = 1) -> SimpleNamespace:
    return SimpleNamespace(engine=SimpleNamespace(device=device),
                           parallel=SimpleNamespace(workers=workers, executor=executor, pipeline_stages=stages))


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


@pytest.mark.parametrize("gpus, stages, expected", [
    ("0,1", 2, False),      # two GPUs, two stages: one engine spanning both, here
    ("0,1,2,3", 2, True),   # four GPUs, two stages: two engines
])
def test_an_engine_of_pipeline_stages_counts_as_one(monkeypatch, gpus, stages, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus)
    assert runs_in_workers(spec("auto", "auto", stages=stages)) is expected


def test_every_run_gets_one_executor_protocol(monkeypatch):
    from batchinfer.jobs.run.in_process import InProcessExecutor
    from batchinfer.jobs.run.job_executor import JobExecutor, job_executor
    from batchinfer.jobs.run.parallel_run import WorkersExecutor

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    job = SimpleNamespace(spec=spec("cpu", 1))
    here = job_executor(job, None, lambda *_: None, 8, progress=None, before_commit=lambda: None)
    workers = job_executor(SimpleNamespace(spec=spec("cpu", 2)), None, lambda *_: None, 8, None, lambda: None)
    own = job_executor(job, lambda *args, **kwargs: None, lambda *_: None, 8, None, lambda: None)
    assert isinstance(here, InProcessExecutor) and isinstance(workers, WorkersExecutor)
    assert isinstance(own, WorkersExecutor)  # a caller's unit executor runs the units, not this process
    names = [name for name in vars(JobExecutor) if not name.startswith("_")]
    assert {"start", "planned", "ready", "run", "flush_partial", "samples_written"} <= set(names)
    for executor in (here, workers):
        assert all(hasattr(executor, name) for name in names)
    assert workers.ready() == {} and workers.samples_written == 0 and workers.engine_stats() is None
