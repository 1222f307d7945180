"""`id_column` values are unique or the job is refused at planning time (exit 2 naming the column
and a value two rows share): the id keys each row's samples, so two rows with one id cannot be
told apart in the results, and would sample alike."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import batchinfer.jobs.global_plan.unique_ids as unique_ids
from batchinfer.jobs.global_plan.unique_ids import IdHashes, duplicate_id
from tests.cli_utils import invoke_cli
from tests.job_process import demo_cache  # noqa: F401
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

ROWS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_duplicated_id_is_one_line_exit_2_naming_the_column_and_the_value(tmp_path, demo_cache, command):
    table = rag_table(ROWS)
    ids = table["qid"].to_pylist()
    ids[9] = ids[4]  # rows 4 and 9 share q0004
    write_parquet(table.set_column(0, "qid", pa.array(ids)), tmp_path / "data" / "rag.parquet", row_group_size=5)
    write_job_file(tmp_path, [job_entry(model="demo", id_column="qid", engine={"device": "cpu"})])
    result = invoke_cli(tmp_path, command, "jobs.yaml")
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.splitlines() == [
        "error: jobs.yaml: jobs.rag.id_column: column 'qid' has the value 'q0004' in rows 4 and 9: ids must be "
        "unique (each keys its row's samples, seeds and results)"]
    assert not list((tmp_path / "out" / "rag").glob("part-*.parquet")) if command == "run" else \
        not (tmp_path / "out").exists()


def test_unique_ids_pass_and_a_limit_leaves_a_duplicate_past_it_out(tmp_path, checkpoint):
    table = rag_table(ROWS)
    ids = table["qid"].to_pylist()
    ids[11] = ids[0]
    write_parquet(table.set_column(0, "qid", pa.array(ids)), tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint), id_column="qid", limit=11)])
    result = invoke_cli(tmp_path, "plan", "jobs.yaml")
    assert result.exit_code == 0, (result.output, result.exception)


def test_the_hashes_find_a_duplicate_across_flushes_and_partitions_and_only_a_real_one(tmp_path, monkeypatch):
    monkeypatch.setattr(unique_ids, "FLUSH_HASHES", 1000)
    windows = [(first, pa.array(np.arange(first, first + 4000))) for first in range(0, 40_000, 4000)]
    windows.append((40_000, pa.array([None, None, 17, None])))  # nulls are no ids; 17 is row 17's too
    hashes = IdHashes(tmp_path / "ids")
    for _, column in windows:
        hashes.add(column)
    repeated = hashes.repeated()
    assert len(repeated) == 1 and len(list((tmp_path / "ids").iterdir())) > 100
    assert duplicate_id(windows, repeated) == (17, 17, 40_002)
    assert duplicate_id(windows[:-1], repeated) is None  # a hash that repeats but no value does: a collision


def test_dictionary_encoded_ids_are_compared_by_value_across_windows(tmp_path):
    first = pa.array(["x", "y"]).dictionary_encode()
    second = pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array(["z", "x"]))  # x: index 1 here
    hashes = IdHashes(tmp_path / "ids")
    hashes.add(first)
    hashes.add(second)
    assert duplicate_id([(0, first), (2, second)], hashes.repeated()) == ("x", 0, 3)
