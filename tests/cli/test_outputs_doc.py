"""docs/OUTPUTS.md cannot go stale: every job kind runs through the CLI on the tiny random demo checkpoint
(generate with n samples and eval, structured output with logprobs and the reasoning split, scoring, the
OpenAI batch files in both error forms), and every column, `_stats.json` key and batch output
line key written must be named (in backticks) in its section of the reference."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.job_process import REPO_ROOT
from tests.jobs_fixtures import job_entry, rag_table, write_parquet
from tests.random_demo_jobs import run_random_demo_jobs

pytestmark = pytest.mark.slow
DOC = REPO_ROOT / "docs" / "OUTPUTS.md"
SECTIONS = {"columns": "## Output columns", "stats": "## `_stats.json`", "batch": "## OpenAI batch output lines"}
# Keys that are values, not names: a sampling key under `sampling.values`, a phase under `startup_seconds`, ...
OPEN_MAPPINGS = {"values", "sources", "per_worker", "top_logprobs", "engine_settings"}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _named(section: str) -> set[str]:
    return set(re.findall(r"`([^`\s]+)`", section))


def _keys(value: Any, path: str = "") -> Iterator[str]:
    """Every key of a JSON value, nested ones as `parent.key` (list items under their list's name)."""
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if path else key
            yield name
            if key not in OPEN_MAPPINGS:
                yield from _keys(item, name)
    elif isinstance(value, list):
        for item in value:
            yield from _keys(item, path)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("outputs")
    rows = 6
    table = rag_table(rows).append_column("answer", pa.array(["yes", "no"] * (rows // 2)))
    table = table.append_column("choices", pa.array([["yes", "no"], ["a b", "c"]] * (rows // 2)))
    write_parquet(table, folder / "data" / "rag.parquet")
    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                  "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "t1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon", "max_tokens": 3, "n": 2, "logprobs": 1}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "suffix": "y"}},
    ]
    (folder / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = {"model": "demo", "engine": {"device": "cpu", "max_running": 4},
              "sampling": {"max_tokens": 4, "seed": 1}}
    batch = {**common, "input": "requests.jsonl", "reasoning": "split"}
    jobs = [
        job_entry(name="gen", **common, id_column="qid", output={"path": "out/gen"},
                  eval={"answer_column": "answer", "metric": "exact_match"}) | {"sampling": {"max_tokens": 4, "n": 2}},
        job_entry(name="structured", **common, reasoning="split", output={"path": "out/structured"})
        | {"sampling": {"max_tokens": 6, "choice": ["yes", "no"], "logprobs": 2}},
        job_entry(name="score", **common, task="score", score={"continuations_column": "choices"},
                  eval={"answer_column": "answer", "metric": "choice_accuracy"}, output={"path": "out/score"}),
        {"name": "batch", **batch, "output": {"path": "out/batch", "format": "openai"}},
        {"name": "batch_vllm", **batch, "output": {"path": "out/batch_vllm", "format": "openai", "error_form": "vllm"}},
    ]
    return run_random_demo_jobs(folder, tmp_path_factory.getbasetemp() / "demo-cache", jobs)


def test_every_written_column_is_in_the_reference(outputs):
    named = _named(_section(DOC.read_text(), SECTIONS["columns"]))
    inputs = set(pq.read_schema(outputs.parent / "data" / "rag.parquet").names)
    written = set()
    for job in outputs.iterdir():
        written |= set(pq.read_table(job).column_names)
        for row in pq.read_table(job).to_pylist()[:1]:  # struct fields of list columns (logprobs)
            for entry in row.get("logprobs") or []:
                written |= {f"logprobs.{key}" for key in entry}
    missing = sorted(written - inputs - named)
    assert not missing, f"columns written but not in docs/OUTPUTS.md: {missing}"
    assert {"correct", "continuation_logprobs", "logprobs", "reasoning_text", "custom_id"} <= written


def test_every_stats_key_is_in_the_reference(outputs):
    named = _named(_section(DOC.read_text(), SECTIONS["stats"]))
    written = set()
    for job in outputs.iterdir():
        written |= set(_keys(json.loads((job / "_stats.json").read_text())))
    missing = sorted(written - named)
    assert not missing, f"_stats.json keys written but not in docs/OUTPUTS.md: {missing}"
    assert {"eval.accuracy", "plan.global_ideal_cached_tokens"} <= written


def test_every_batch_output_line_key_is_in_the_reference(outputs):
    named = _named(_section(DOC.read_text(), SECTIONS["batch"]))
    written = set()
    for name in ("batch/_batch_output.jsonl", "batch/_batch_errors.jsonl", "batch_vllm/_batch_output.jsonl"):
        for line in (outputs / name).read_text().splitlines():
            written |= set(_keys(json.loads(line)))
    missing = sorted(written - named)
    assert not missing, f"batch output line keys written but not in docs/OUTPUTS.md: {missing}"
    assert {"response.body.error.param", "error.error.message", "response.body.choices.logprobs.content"} <= written


def test_the_readme_links_the_reference():
    assert "docs/OUTPUTS.md" in (REPO_ROOT / "README.md").read_text()
