"""The two ways a job can fail, and how the CLI reports them.

`JobError` is bad input (job file, input data, checkpoint, output folder): it is raised
before anything is written, and the CLI prints it as one line and exits 2.
`JobRuntimeError` is a failure while running (out of memory, CUDA error): parts already
finished stay on disk, and the CLI exits 1. A full disk (ENOSPC, or EDQUOT: a quota) anywhere
in a run, in the output folder or TMPDIR, is one such failure, said in one line (`no_space_line`).
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


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


def no_space_error(exc: BaseException) -> Optional[OSError]:
    """The ENOSPC / EDQUOT error behind `exc` (itself, or what it was raised from or during), if any."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE_ERRNOS:
            return current
        current = current.__cause__ or current.__context__
    return None


def no_space_line(exc: BaseException, out_dir: Optional[Path] = None) -> Optional[str]:
    """`no space left on device: <path>; ...` when `exc` comes from a full disk, else None.

    <path> is the file being written when the error names it; pyarrow's writes do not, and then it
    is the job's output folder or TMPDIR (the planning's scratch), whichever filled up."""
    error = no_space_error(exc)
    if error is None:
        return None
    if error.filename:
        where = display_path(os.fsdecode(error.filename))
    else:
        folder = display_path(out_dir) if out_dir is not None else "the output folder"
        where = f"{folder} or TMPDIR ({tempfile.gettempdir()})"
    return f"no space left on device: {where}; finished parts kept, rerun to resume"
