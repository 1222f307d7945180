"""The job's `parallel:` block: how many engines run the job's work units, and where.

`PARALLEL_KEYS` is the key → value checker table `jobs/spec/job_file.py` validates the block with;
`ParallelSpec` is its frozen result (`JobSpec.parallel`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from batchinfer.jobs.spec import checks as check
from batchinfer.jobs.spec.executors import EXECUTORS, executor_problem


def workers_count(value: Any) -> Union[str, int]:
    """`auto` (one engine per visible GPU, 1 on the CPU) or a number of engines >= 1."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be auto or an integer >= 1, got {value!r}")
    return value


def executor_name(value: Any) -> str:
    """`local` or `ray`; `ray` only where Ray is installed, so `run` and `plan` both refuse it at validation."""
    value = check.choice(*EXECUTORS)(value)
    problem = executor_problem(value)
    if problem is not None:
        raise ValueError(problem.removeprefix("executor: "))  # the key is already in the error's location
    return value


def stages_count(value: Any) -> int:
    """Pipeline stages per engine: an integer >= 1 (its layers split over that many GPUs)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be an integer >= 1, got {value!r}")
    return value


PARALLEL_KEYS: dict[str, Callable[[Any], Any]] = {
    "workers": workers_count,
    "pipeline_stages": stages_count,
    "executor": executor_name,
    "ray_address": check.text(),
}


@dataclass(frozen=True)
class ParallelSpec:
    workers: Union[str, int] = "auto"   # "auto" or a count
    executor: str = "local"             # local: processes on this host | ray: actors on a Ray cluster
    ray_address: str = "auto"           # given to ray.init(address=...) as it is
    pipeline_stages: int = 1            # each engine's layers split over this many GPUs (models/pipeline.py)
