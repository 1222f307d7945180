"""Rows that used to crash a whole job: text that is not UTF-8, and a template without columns.

`run` goes through `run_job` with the fake engine (as tests/jobs/run/test_jobs_runner.py), `plan` through
the CLI (it loads no model): both must finish, with the bad rows as row errors.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.cli_utils import invoke_cli, table_cells
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

ROWS = 9
BAD_ROW = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def table_with_bad_bytes() -> pa.Table:
    """rag_table(ROWS) with row BAD_ROW's document holding bytes that are not UTF-8."""
    table = rag_table(ROWS)
    documents = [value.encode() for value in table["document"].to_pylist()]
    documents[BAD_ROW] = b"caf\xe9 \xff\xfe"  # Latin-1, as a careless export writes it
    bad = pa.array(documents, pa.binary()).view(pa.string())
    return table.set_column(table.schema.get_field_index("document"), "document", bad)


def make_job(folder: Path, checkpoint: Path, table: pa.Table, **overrides) -> Path:
    write_parquet(table, folder / "data" / "rag.parquet", row_group_size=4)
    return write_job_file(folder, [job_entry(model=str(checkpoint), **overrides)])


def run(job_file: Path) -> pa.Table:
    job = prepare_job(load_job_file(job_file).jobs[0])
    run_job(job, Console(quiet=True), engine_factory=lambda _job, _rows: FakeEngine(), window_rows=4)
    return pq.read_table(job_file.parent / "out" / "rag").sort_by("row_index")


def plan_lines(folder: Path) -> dict[str, str]:
    result = invoke_cli(folder, "plan", "jobs.yaml")
    assert result.exit_code == 0, (result.output, result.exception)
    return {cells[0]: cells[1] for cells in table_cells(result.stdout) if len(cells) == 2}


def test_text_that_is_not_utf8_is_that_rows_error_and_the_job_completes(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint, table_with_bad_bytes())
    out = run(job_file)
    assert out["row_index"].to_pylist() == list(range(ROWS))
    errors = out["error"].to_pylist()
    assert errors[BAD_ROW] == "column 'document' is not valid UTF-8"
    assert out["finish_reason"].to_pylist()[BAD_ROW] == "error"
    assert all(error is None for row, error in enumerate(errors) if row != BAD_ROW)
    assert out["document"].to_pylist()[BAD_ROW] == "caf\ufffd \ufffd\ufffd"  # invalid bytes written as U+FFFD


def test_plan_counts_a_row_that_is_not_utf8_as_an_error_row(tmp_path, checkpoint):
    make_job(tmp_path, checkpoint, table_with_bad_bytes())
    shown = plan_lines(tmp_path)
    assert (shown["rows"], shown["rows without a prompt (errors)"]) == (str(ROWS), "1")


def test_a_template_without_columns_gives_every_row_the_same_prompt(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint, rag_table(ROWS), prompt={"template": "Write a haiku."},
                        sampling={"max_tokens": 4, "n": 2})
    out = run(job_file)
    assert out.num_rows == ROWS * 2 and set(out["error"].to_pylist()) == {None}
    assert len(set(out["prompt_tokens"].to_pylist())) == 1
    shown = plan_lines(tmp_path)
    assert (shown["rows"], shown["samples"], shown["rows without a prompt (errors)"]) == \
        (str(ROWS), str(ROWS * 2), "0")


def test_an_id_column_that_is_not_utf8_is_that_rows_error_in_run_and_plan(tmp_path, checkpoint):
    table = rag_table(ROWS)
    ids = [value.encode() for value in table["qid"].to_pylist()]
    ids[BAD_ROW] = b"q\xff"
    table = table.set_column(0, "qid", pa.array(ids, pa.binary()).view(pa.string()))
    job_file = make_job(tmp_path, checkpoint, table, id_column="qid")
    assert plan_lines(tmp_path)["rows without a prompt (errors)"] == "1"
    errors = run(job_file)["error"].to_pylist()
    assert errors[BAD_ROW] == "column 'qid' is not valid UTF-8"
    assert all(error is None for row, error in enumerate(errors) if row != BAD_ROW)
