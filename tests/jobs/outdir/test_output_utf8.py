"""Every output part is readable by polars and pyarrow (and DuckDB, where installed), whatever bytes
the input's string columns hold: invalid UTF-8 is written as U+FFFD and named in the row's error."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from batchinfer.jobs.outdir.valid_text import repair_array, repair_table
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

ROWS = 9
PROMPT_ROW, NOTES_ROW, TAGS_ROW = 4, 2, 6


def as_string(values: list, kind: pa.DataType = pa.string()) -> pa.Array:
    """Bytes typed as text without a UTF-8 check, as a careless Parquet export writes them."""
    return pa.array(values, pa.large_binary() if kind == pa.large_string() else pa.binary()).cast(kind, safe=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def hostile_table() -> pa.Table:
    table = rag_table(ROWS)
    documents = [value.encode() for value in table["document"].to_pylist()]
    documents[PROMPT_ROW] = b"caf\xe9 \xff"
    notes = [f"note {row}".encode() for row in range(ROWS)]
    notes[NOTES_ROW] = b"bad \xc3"
    tags = [[b"t", f"{row}".encode()] for row in range(ROWS)]
    tags[TAGS_ROW] = [b"\xfe"]
    return table.set_column(table.schema.get_field_index("document"), "document", as_string(documents)) \
        .append_column("notes", as_string(notes, pa.large_string()).dictionary_encode()) \
        .append_column("blob", pa.array([bytes([row, 0xff]) for row in range(ROWS)], pa.binary())) \
        .append_column("tags", pa.array(tags, pa.list_(pa.binary())).cast(pa.list_(pa.string()), safe=False))


def run_hostile_job(folder: Path, checkpoint: Path, plan: str) -> Path:
    write_parquet(hostile_table(), folder / "data" / "rag.parquet", row_group_size=4)
    job_file = write_job_file(folder, [job_entry(model=str(checkpoint))])
    job = prepare_job(load_job_file(job_file).jobs[0])
    run_job(job, Console(quiet=True), engine_factory=lambda _job, _rows: FakeEngine(), window_rows=4, plan=plan)
    return folder / "out" / "rag"


@pytest.mark.parametrize("plan", ["global", "window"])
def test_every_part_reads_in_polars_and_pyarrow_and_bad_rows_say_why(tmp_path, checkpoint, plan):
    out = run_hostile_job(tmp_path, checkpoint, plan)
    parts = sorted(out.glob("part-*.parquet"))
    assert parts
    for part in parts:
        pl.read_parquet(part)  # raised "String data contained invalid UTF-8" on the bytes copied as they were
        pq.read_table(part).validate(full=True)
    frame = pl.read_parquet(out / "*.parquet").sort("row_index")
    table = pq.read_table(out).sort_by("row_index")
    assert table.to_pylist() == frame.to_arrow().cast(table.schema).to_pylist()
    rows = table.to_pylist()
    assert rows[PROMPT_ROW]["document"] == "caf\ufffd \ufffd"
    assert (rows[PROMPT_ROW]["finish_reason"], rows[PROMPT_ROW]["error"]) == \
        ("error", "column 'document' is not valid UTF-8")
    # A column the prompt does not read: the row runs, its value is repaired and its error says so.
    assert rows[NOTES_ROW]["notes"] == "bad \ufffd" and rows[NOTES_ROW]["finish_reason"] != "error"
    assert rows[NOTES_ROW]["error"] == "column 'notes' is not valid UTF-8 (invalid bytes written as U+FFFD)"
    assert rows[TAGS_ROW]["tags"] == ["\ufffd"] and "column 'tags'" in rows[TAGS_ROW]["error"]
    assert [row["blob"] for row in rows] == [bytes([row, 0xff]) for row in range(ROWS)]  # binary stays bytes
    assert all(row["error"] is None for row in rows if row["row_index"] not in (PROMPT_ROW, NOTES_ROW, TAGS_ROW))
    if importlib.util.find_spec("duckdb") is not None:  # not a test dependency
        import duckdb

        assert duckdb.sql(f"select count(*) from read_parquet('{out}/*.parquet')").fetchone()[0] == ROWS


@pytest.mark.parametrize("array, expected, bad", [
    (as_string([b"ok", b"\xff", None]), ["ok", "\ufffd", None], [False, True, False]),
    (as_string([b"ok", b"a\xe9b"], pa.large_string()), ["ok", "a\ufffdb"], [False, True]),
    (as_string([b"ok", b"\xff"]).cast(pa.string_view(), safe=False), ["ok", "\ufffd"], [False, True]),
    (as_string([b"x", b"\xff", b"x"]).dictionary_encode(), ["x", "\ufffd", "x"], [False, True, False]),
    (pa.array([[b"ok"], None, [b"\xff", b"y"]], pa.list_(pa.binary())).cast(pa.list_(pa.string()), safe=False),
     [["ok"], None, ["\ufffd", "y"]], [False, False, True]),
    (pa.StructArray.from_arrays([as_string([b"ok", b"\xff"]), pa.array([1, 2])], ["s", "n"]),
     [{"s": "ok", "n": 1}, {"s": "\ufffd", "n": 2}], [False, True]),
    (pa.MapArray.from_arrays(pa.array([0, 1, 2]), as_string([b"k", b"\xff"]), pa.array([1, 2])),
     [[("k", 1)], None], [False, True]),  # a map holding invalid text is written as null
])
def test_repair_makes_every_text_type_valid_and_names_the_rows(array, expected, bad):
    for start in (0, 1):  # a slice shares its parent's buffers, invalid bytes outside it included
        repaired, changed = repair_array(array.slice(start))
        repaired.validate(full=True)
        assert repaired.type == array.type
        assert repaired.to_pylist() == expected[start:] and changed.tolist() == bad[start:]


def test_a_valid_table_is_returned_as_it_is():
    table = rag_table(5)
    repaired, changed = repair_table(table)
    assert repaired is table and changed == {}


def _text_cells(values: list) -> pa.Array:
    return pa.array(values, pa.binary()).cast(pa.string(), safe=False)


def test_invalid_utf8_in_a_score_rows_continuations_is_that_rows_error(tmp_path, checkpoint):
    """The continuations cell is read by the job (not only carried): a cell with invalid bytes
    used to fail the whole job with a UnicodeDecodeError; now it is its row's error."""
    from tests.engine_utils import demo_engine_fp32

    choices = pa.array([[b"Paris", b"Lyon"], [b"re\xffd", b"blue"], [b"yes", b"no"]],
                       pa.list_(pa.binary())).cast(pa.list_(pa.string()), safe=False)
    write_parquet(pa.table({"question": ["One?", "Two?", "Three?"], "choices": choices}),
                  tmp_path / "data" / "rag.parquet")
    entry = job_entry(model=str(checkpoint), prompt={"template": "{question} Answer:"}, task="score",
                      score={"continuations_column": "choices"})
    job = prepare_job(load_job_file(write_job_file(tmp_path, [entry])).jobs[0])
    stats = run_job(job, Console(quiet=True), engine_factory=lambda _job, _rows: demo_engine_fp32())
    rows = pq.read_table(tmp_path / "out" / "rag").sort_by("row_index").to_pylist()
    assert stats["status"] == "done" and len(rows) == 3
    assert (rows[1]["finish_reason"], rows[1]["error"]) == ("error", "column 'choices' is not valid UTF-8")
    assert rows[1]["choices"] == ["re\ufffdd", "blue"]  # carried, repaired
    assert all(rows[r]["error"] is None and rows[r]["finish_reason"] != "error" for r in (0, 2))


def test_invalid_utf8_in_a_rows_json_schema_is_that_rows_error(tmp_path, checkpoint):
    schema = b'{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    schemas = _text_cells([schema, schema[:-1] + b'\xff}', schema])
    write_parquet(pa.table({"q": ["a", "b", "c"], "schema": schemas}), tmp_path / "data" / "rag.parquet")
    entry = job_entry(model=str(checkpoint), prompt={"template": "{q}"},
                      sampling={"max_tokens": 4, "json_schema_column": "schema"})
    job = prepare_job(load_job_file(write_job_file(tmp_path, [entry])).jobs[0])
    stats = run_job(job, Console(quiet=True), engine_factory=lambda _job, _rows: FakeEngine())
    rows = pq.read_table(tmp_path / "out" / "rag").sort_by("row_index").to_pylist()
    assert stats["status"] == "done" and len(rows) == 3
    assert (rows[1]["finish_reason"], rows[1]["error"]) == ("error", "column 'schema' is not valid UTF-8")
    assert all(rows[r]["error"] is None for r in (0, 2))
