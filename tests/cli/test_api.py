"""The Python API (batchinfer.run, batchinfer.LLM) against the CLI on the same jobs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchinfer
from batchinfer.jobs.errors import JobError

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "{document}\nQuestion: {question}\nAnswer:"
GENERATED = ["row_index", "sample_index", "generated_text", "output_token_ids", "prompt_tokens", "cached_tokens",
             "completion_tokens", "finish_reason", "error"]
REUSE = ["prompt_tokens", "cached_tokens", "planned_cached_tokens"]


@pytest.fixture(scope="module")
def demo_rows() -> pa.Table:
    return pq.read_table(REPO / "examples" / "rag_demo.parquet").slice(0, 20)


def _job(tmp_path: Path, table: pa.Table, name: str = "rag") -> dict:
    pq.write_table(table, tmp_path / f"{name}.parquet")
    return {"name": name, "model": "demo", "input": f"{name}.parquet", "prompt": {"template": TEMPLATE},
            "sampling": {"max_tokens": 6, "temperature": 0.0}, "engine": {"device": "cpu"},
            "output": {"path": f"out/{name}", "order": "input"}}


def _rows(folder: Path) -> pa.Table:
    return pq.read_table(folder).select(GENERATED).sort_by([("row_index", "ascending"), ("sample_index", "ascending")])


@pytest.mark.slow
def test_run_a_job_dict_writes_what_the_cli_writes(tmp_path, demo_rows):
    api_dir, cli_dir = tmp_path / "api", tmp_path / "cli"
    api_dir.mkdir(), cli_dir.mkdir()
    stats = batchinfer.run({"jobs": [_job(api_dir, demo_rows)]}, base_dir=api_dir, progress=False)
    import yaml
    (cli_dir / "jobs.yaml").write_text(yaml.safe_dump({"jobs": [_job(cli_dir, demo_rows)]}))
    done = subprocess.run([sys.executable, "-m", "batchinfer", "run", "jobs.yaml"], cwd=cli_dir, capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    import json
    cli_stats = json.loads((cli_dir / "out" / "rag" / "_stats.json").read_text())
    assert _rows(api_dir / "out" / "rag").equals(_rows(cli_dir / "out" / "rag"))
    assert {k: stats[k] for k in REUSE} == {k: cli_stats[k] for k in REUSE}
    assert stats["status"] == "done" and stats["cached_tokens"] > 0


def test_run_returns_each_jobs_stats_by_name(tmp_path, demo_rows):
    jobs = [_job(tmp_path, demo_rows.slice(0, 3), "a"), _job(tmp_path, demo_rows.slice(3, 3), "b")]
    stats = batchinfer.run({"jobs": jobs}, base_dir=tmp_path, progress=False)
    assert set(stats) == {"a", "b"} and stats["a"]["rows"] == 3 and stats["b"]["rows"] == 3
    again = batchinfer.run({"jobs": jobs}, name="a", base_dir=tmp_path, progress=False)  # finished: nothing runs
    assert {k: again[k] for k in ("rows", "samples", "samples_written")} == {"rows": 3, "samples": 3, "samples_written": 3}


def test_run_reports_bad_jobs_as_job_errors(tmp_path):
    with pytest.raises(JobError, match="model"):
        batchinfer.run({"jobs": [{"name": "x", "input": "x.parquet", "prompt": {"column": "p"}}]}, base_dir=tmp_path)


@pytest.fixture(scope="module")
def llm():
    with batchinfer.LLM("demo", device="cpu") as model:
        yield model


def test_generate_from_a_table_matches_a_job_on_the_same_rows(tmp_path, llm, demo_rows):
    job_stats = batchinfer.run({"jobs": [_job(tmp_path, demo_rows)]}, base_dir=tmp_path, progress=False)
    table = llm.generate(demo_rows, template=TEMPLATE, sampling={"max_tokens": 6, "temperature": 0.0})
    assert isinstance(table, pa.Table) and set(demo_rows.column_names) <= set(table.column_names)
    assert table.select(GENERATED).equals(_rows(tmp_path / "out" / "rag"))
    assert {k: llm.last_stats[k] for k in REUSE} == {k: job_stats[k] for k in REUSE}
    frame = llm.generate(pl.from_arrow(demo_rows.slice(0, 4)), template=TEMPLATE, sampling={"max_tokens": 6})
    assert isinstance(frame, pl.DataFrame) and frame["generated_text"].to_list() == table["generated_text"].to_pylist()[:4]


def test_each_call_reports_its_own_counters(llm, demo_rows):
    prompts = [TEMPLATE.format(**row) for row in demo_rows.slice(0, 4).to_pylist()]
    llm.generate(prompts, sampling={"max_tokens": 4})
    first = llm.last_stats
    llm.generate(prompts, sampling={"max_tokens": 4})
    assert llm.last_stats["prompt_tokens"] == first["prompt_tokens"]  # not the engine's running total
    assert llm.last_stats["output_tokens"] == first["output_tokens"] == 16


def test_generate_from_strings_and_conversations(llm, demo_rows):
    row = demo_rows.to_pylist()[0]
    rows = llm.generate([TEMPLATE.format(**row)], sampling={"max_tokens": 8, "stop": ["\n"]})
    assert len(rows) == 1 and rows[0]["generated_text"].strip() == row["answer"]
    conversation = [{"role": "user", "content": f"{row['document']}\nQuestion: {row['question']}"}]
    as_chat = llm.generate([f"{row['document']}\nQuestion: {row['question']}"], chat=True, sampling={"max_tokens": 4})
    as_messages = llm.generate([conversation], sampling={"max_tokens": 4})
    assert as_messages[0]["output_token_ids"] == as_chat[0]["output_token_ids"]


def test_bad_prompts_are_job_errors(llm, demo_rows):
    with pytest.raises(JobError, match="list of strings"):
        llm.generate([1, 2])
    with pytest.raises(JobError, match="template= or column="):
        llm.generate(demo_rows)
    with pytest.raises(JobError, match="max_tokens"):
        llm.generate(["x"], sampling={"max_tokens": -1})


def test_ctrl_c_closes_the_engine_and_the_next_call_runs(demo_rows):
    model = batchinfer.LLM("demo", device="cpu")
    prompts = [TEMPLATE.format(**row) for row in demo_rows.slice(0, 6).to_pylist()]
    expected = [r["generated_text"] for r in model.generate(prompts, sampling={"max_tokens": 4})]
    engine = model._engine
    real = engine.generate_units

    def interrupted(units):
        for i, output in enumerate(real(units)):
            if i == 2:
                raise KeyboardInterrupt
            yield output

    engine.generate_units = interrupted
    with pytest.raises(KeyboardInterrupt):
        model.generate(prompts, sampling={"max_tokens": 4})
    assert model._engine is None  # closed, not left holding half-run sequences
    assert [r["generated_text"] for r in model.generate(prompts, sampling={"max_tokens": 4})] == expected
    model.close()


@pytest.mark.slow
def test_the_readme_python_example_runs_as_written(tmp_path):
    import os
    import re
    import shutil
    readme = (REPO / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("out"))
    done = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = done.stdout.strip().splitlines()[-2:]
    assert first.endswith(" 1.0")  # the demo answers all 48 right
    assert second.startswith("[' 4321', ' 1234']")
