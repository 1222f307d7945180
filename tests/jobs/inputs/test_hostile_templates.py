"""Chat templates are the checkpoint's code: whatever one raises while rendering a row makes that
row an error row, never a crashed job (jobs/inputs/tokenizer.py wraps it, jobs/inputs/prompts.py records it)."""
from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
import pytest

from batchinfer.jobs.formats.openai_batch import read_batch_file
from batchinfer.jobs.inputs.prompts import build_prompts
from batchinfer.jobs.tasks.reasoning import reasoning_split
from batchinfer.jobs.spec.job_file import PromptSpec, load_job_file
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, write_job_file

HOSTILE = {  # template → what the row's error names
    "division": ("{{ 1/0 }}", "ZeroDivisionError"),
    "include_without_loader": ("{% include 'other.jinja' %}", "no loader"),
    "string_plus_int": ("{{ messages[0].content + 5 }}", "can only concatenate"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _with_template(checkpoint, source: str) -> CheckpointTokenizer:
    base = CheckpointTokenizer.from_checkpoint(checkpoint)
    return CheckpointTokenizer(base.tokenizer, source, base.special_tokens, base.eos_token_ids)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_template_that_raises_anything_makes_each_row_an_error_row(checkpoint, name):
    source, named = HOSTILE[name]
    table = pa.table({"text": ["hello", None, "bye"]})
    batch = build_prompts(table, PromptSpec(column="text"), _with_template(checkpoint, source), chat=True,
                          system=None, vocab_size=1024)
    assert batch.token_ids == [None, None, None]
    assert batch.errors[1] == "prompt column 'text' is null"  # the row's own error comes first
    for error in (batch.errors[0], batch.errors[2]):
        assert error.startswith("chat template: ") and named in error and "\n" not in error


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_reasoning_probe_and_openai_chat_lines_survive_a_raising_template(tmp_path, checkpoint, name):
    source, named = HOSTILE[name]
    tokenizer = _with_template(checkpoint, source)
    spec = load_job_file(write_job_file(tmp_path, [job_entry(model=str(checkpoint), chat=True)])).jobs[0]
    assert reasoning_split(replace(spec, reasoning="auto"), tokenizer).starts_inside is False
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                        '"body": {"messages": [{"role": "user", "content": "hi"}]}}\n')
    table = read_batch_file(requests, tokenizer)
    assert table.num_rows == 1 and named in table["request_error"][0].as_py()
