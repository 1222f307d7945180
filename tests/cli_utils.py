"""`batchinfer` through click's runner in this process (no interpreter start-up), for tests of the
CLI's output and exit codes; tests of what only a process shows use tests/job_process.py."""
from __future__ import annotations

import os
from pathlib import Path

from click.testing import CliRunner, Result


def invoke_cli(folder: Path, *args: str) -> Result:
    """`batchinfer ARGS` with `folder` as the working directory (so displayed paths are relative)."""
    from batchinfer.cli import main

    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return CliRunner().invoke(main, list(args))
    finally:
        os.chdir(cwd)


def table_cells(output: str) -> list[list[str]]:
    """The cells of each line of a `batchinfer plan` table (a line without `│` is one cell)."""
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in output.splitlines()]
