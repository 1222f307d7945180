"""`_work/` files are verified like parts: after a kill -9, bytes damaged in a committed planning
file make the rerun rebuild that file (a one-line note), keep every finished part and complete
each (row, sample) once; `batchinfer plan` plans afresh instead of crashing."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchinfer.jobs.global_plan.store import work_dir_for
from tests.cli_utils import invoke_cli
from tests.jobs.outdir.test_units_resume import (all_pairs, checkpoint, comparable, kill_at, make_job, out_of, pairs,  # noqa: F401
                                     parts_of, read_output, reference, run)

pytestmark = pytest.mark.slow  # kill -9 and rerun of whole jobs


def damage(path: Path, count: int = 16) -> None:
    """Overwrite `count` bytes in the middle of the file (its size kept)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(255 - b for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("pattern, rebuilt", [
    ("units-*.parquet", "planning again"),
    ("sorted.parquet", "planning again"),
    ("inputs-*/bucket-00000.parquet", "bucketing the unit inputs again"),
    ("inputs-*/row_units.npy", "bucketing the unit inputs again"),
])
def test_damaged_work_files_are_rebuilt_and_the_rerun_keeps_every_finished_part(tmp_path, checkpoint, reference,
                                                                              pattern, rebuilt):
    job_file = make_job(tmp_path, checkpoint)
    kill_at(job_file, "batchinfer.jobs.outdir.part_writer", "commit_part", after=5)
    before = {p.name: p.read_bytes() for p in parts_of(tmp_path)}
    (target,) = work_dir_for(out_of(tmp_path)).glob(pattern)
    damage(target)
    planned = invoke_cli(tmp_path, "plan", "jobs.yaml")
    assert planned.exit_code == 0, (planned.output, planned.exception)
    warnings = []
    stats = run(job_file, warnings=warnings)
    assert len(warnings) == 1 and warnings[0].startswith(f"{target}: damaged (") and rebuilt in warnings[0]
    out = read_output(tmp_path)
    assert pairs(out) == all_pairs() and comparable(out).equals(comparable(reference))
    assert {name: (out_of(tmp_path) / name).read_bytes() for name in before} == before  # kept, never rewritten
    assert stats["samples_resumed"] == sum(pq.read_metadata(out_of(tmp_path) / name).num_rows for name in before)
