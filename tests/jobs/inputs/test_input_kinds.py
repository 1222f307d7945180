"""Inputs beyond Parquet (jobs/inputs/readers.py): CSV, JSON Lines rows, Arrow IPC / Feather and a
Hugging Face `save_to_disk` folder each run as a real job on the demo model and give the rows the same
data gives as Parquet; a finished job's rerun writes nothing; a broken CSV is a one-line exit 2."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pytest

from tests.job_process import demo_cache, read_parts, run_in_this_process  # noqa: F401 (fixture)
from tests.jobs_fixtures import job_entry, write_job_file, write_parquet

TABLE = pa.table({"qid": ["a", "b", "c", "d"],
                  "document": ["The sky, seen at noon.", "Water boils\nat 100 C.", "Cats sleep.", "Rust is old."],
                  "question": ["What colour?", "When?", "How long?", "What is it?"]})


def write_csv(path: Path) -> None:
    pcsv.write_csv(TABLE, path)


def write_csv_gz(path: Path) -> None:
    write_csv(path.with_suffix(""))
    path.write_bytes(gzip.compress(path.with_suffix("").read_bytes()))
    path.with_suffix("").unlink()


def write_lines(path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in TABLE.to_pylist()))


def write_arrow(path: Path) -> None:
    with ipc.new_file(path, TABLE.schema) as writer:
        writer.write_table(TABLE)


def write_feather(path: Path) -> None:
    feather.write_feather(TABLE, path)


def write_hf(folder: Path) -> None:
    folder.mkdir()
    for index, rows in enumerate((TABLE.slice(0, 3), TABLE.slice(3))):
        with ipc.new_stream(folder / f"data-0000{index}-of-00002.arrow", TABLE.schema) as writer:
            writer.write_table(rows)
    (folder / "dataset_info.json").write_text("{}")
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-0000{i}-of-00002.arrow"}
                                                                   for i in range(2)]}))


KINDS = {"csv": ("rows.csv", write_csv, {}), "csv_gz": ("rows.csv.gz", write_csv_gz, {}),
         "ndjson": ("rows.ndjson", write_lines, {}), "jsonl": ("rows.jsonl", write_lines, {"input_format": "jsonl"}),
         "arrow": ("rows.arrow", write_arrow, {}), "feather": ("rows.feather", write_feather, {}),
         "hf_dataset": ("saved", write_hf, {})}


def run_job(folder: Path, input_name: str, **extra):
    entry = job_entry(model="demo", input=f"data/{input_name}", engine={"device": "cpu", "max_running": 4},
                      sampling={"max_tokens": 5, "seed": 7, "ignore_eos": True}, **extra)
    write_job_file(folder, [entry])
    return run_in_this_process(folder)


def generated(folder: Path) -> list[tuple]:
    table = read_parts(folder / "out" / "rag")
    return list(zip(table["row_index"].to_pylist(), table["qid"].to_pylist(), table["generated_text"].to_pylist()))


@pytest.fixture
def parquet_rows(tmp_path_factory, demo_cache) -> list[tuple]:  # noqa: F811
    folder = tmp_path_factory.mktemp("parquet")
    write_parquet(TABLE, folder / "data" / "rows.parquet")
    result = run_job(folder, "rows.parquet")
    assert result.exit_code == 0, result.output
    return generated(folder)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kind_matches_parquet(kind, tmp_path, parquet_rows):
    name, write, extra = KINDS[kind]
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / name)
    result = run_job(tmp_path, name, **extra)
    assert result.exit_code == 0, result.output
    assert generated(tmp_path) == parquet_rows
    recorded = json.loads((tmp_path / "out" / "rag" / "_job.json").read_text())
    source = tmp_path / "data" / name
    expected = sorted(p.name for p in source.glob("*.arrow")) if source.is_dir() else [name]
    assert [entry["file"] for entry in recorded["fingerprint"]["input"]] == expected  # the user's files
    if kind == "csv":  # a finished job's rerun writes nothing new
        before = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "rag").rglob("part-*")}
        again = run_job(tmp_path, name, **extra)
        assert again.exit_code == 0, again.output
        assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "rag").rglob("part-*")} == before
        (tmp_path / "data" / name).write_text((tmp_path / "data" / name).read_text().replace("Cats", "Dogs"))
        changed = run_job(tmp_path, name, **extra)
        assert changed.exit_code == 2 and "input changed" in changed.output, changed.output


@pytest.mark.parametrize("name, text, expected", [
    ("rows.csv", "qid,document,question\na,x,y\nb,x,y,extra\nc,x,y\n", ("rows.csv", "line 3")),
    ("rows.ndjson", '{"qid": "a", "document": "x", "question": "y"}\n{"qid": \n',
     ("rows.ndjson: not a readable JSON Lines file", "row 1")),
], ids=["csv_names_the_line", "jsonl_names_the_row"])
def test_a_broken_file_is_one_line_naming_where(tmp_path, demo_cache, name, text, expected):  # noqa: F811
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / name).write_text(text)
    result = run_job(tmp_path, name)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and all(part in lines[0] for part in expected), result.output
    assert not (tmp_path / "out").exists()
