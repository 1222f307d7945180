"""The executors a job's `parallel.executor` may name, and whether the chosen one can run here.

Validation needs only these names and Ray's presence, so they live below the executors themselves
(`jobs/run/executors/`): checking a job file never imports the run path, nor Ray.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

RAY_MISSING = "executor: ray needs Ray, which is not installed (pip install 'batchinfer[ray]')"
EXECUTORS = ("local", "ray")


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def executor_problem(executor: str) -> Optional[str]:
    """What is wrong with choosing this executor here, in one line; None when it can run."""
    if executor not in EXECUTORS:
        return f"unknown executor {executor!r} (choose local or ray)"
    if executor == "ray" and not ray_available():
        return RAY_MISSING
    return None
