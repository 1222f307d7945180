"""The two ways a job can fail, and how the CLI reports them.

`JobError` is bad input (job file, input data, checkpoint, output folder): it is raised
before anything is written, and the CLI prints it as one line and exits 2.
`JobRuntimeError` is a failure while running (out of memory, CUDA error): parts already
finished stay on disk, and the CLI exits 1.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union


def display_path(path: Union[str, Path]) -> str:
    """The path as a user would type it: relative to the current folder when inside it."""
    path = Path(path)
    try:
        return os.path.relpath(path) if path.is_absolute() and not os.path.relpath(path).startswith("..") else str(path)
    except ValueError:  # a different drive on Windows
        return str(path)


class JobError(Exception):
    """Bad input, reported as `<file>: <key or column>: <what>`."""

    def __init__(self, file: Union[str, Path], where: str, what: str) -> None:
        self.file = display_path(file)
        self.where = where
        self.what = what
        super().__init__(f"{self.file}: {where}: {what}")


class JobRuntimeError(Exception):
    """A job failed while running; finished parts are kept and a rerun resumes."""

    def __init__(self, job_name: str, reason: str) -> None:
        self.job_name = job_name
        self.reason = reason
        super().__init__(f"job {job_name}: {reason}")
