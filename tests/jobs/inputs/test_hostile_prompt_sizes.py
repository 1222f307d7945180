"""Prompts too long to fit `max_model_len` are refused before tokenising: a job-level text (`system`,
the template's own text) is one error line at validation, a row's text that row's error."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.inputs.prompts import MAX_CHARS_PER_TOKEN, build_prompts, prompt_char_limit
from batchinfer.jobs.spec.job_file import PromptSpec, load_job_file
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet
from tests.cli.test_cli_errors import run_cli

MAX_MODEL_LEN = 64
LIMIT = MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN  # 4096 characters


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


class CountingTokenizer(CheckpointTokenizer):
    """Records the length of every text it is asked to encode."""

    def __init__(self, base: CheckpointTokenizer) -> None:
        super().__init__(base.tokenizer, base.chat_template_source, base.special_tokens, base.eos_token_ids)
        self.encoded: list[int] = []

    def encode_batch(self, texts, add_special_tokens=True):
        self.encoded += [len(text) for text in texts]
        return super().encode_batch(texts, add_special_tokens)


def test_the_limit_is_max_model_len_times_a_generous_chars_per_token():
    assert prompt_char_limit(MAX_MODEL_LEN) == LIMIT and MAX_CHARS_PER_TOKEN >= 32


@pytest.mark.parametrize("entry, key", [
    ({"chat": True, "system": "x" * (LIMIT + 1)}, "jobs.rag.system"),
    ({"prompt": {"template": "y" * (LIMIT + 1) + "{question}"}}, "jobs.rag.prompt.template"),
    ({"chat": True, "chat_template_kwargs": {"extra": "z" * (LIMIT + 1)}}, "jobs.rag.chat_template_kwargs"),
])
def test_a_job_level_text_longer_than_any_prompt_can_be_is_one_line_at_validation(tmp_path, checkpoint, entry, key):
    write_parquet(rag_table(3), tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint), engine={"max_model_len": MAX_MODEL_LEN}, **entry)])
    line = run_cli(tmp_path, "plan", "jobs.yaml")
    assert line.startswith(f"error: jobs.yaml: {key}: has {LIMIT + 1:,} characters"), line


def test_a_job_level_text_at_the_limit_is_accepted(tmp_path, checkpoint):
    write_parquet(rag_table(3), tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint), chat=True, system="x" * LIMIT,
                                        engine={"max_model_len": MAX_MODEL_LEN})])
    job = prepare_job(load_job_file(tmp_path / "jobs.yaml").jobs[0])
    assert job.max_prompt_chars == LIMIT


@pytest.mark.parametrize("chat", [False, True])
def test_a_row_longer_than_the_limit_is_its_error_and_is_never_tokenised(checkpoint, chat):
    tokenizer = CountingTokenizer(CheckpointTokenizer.from_checkpoint(checkpoint))
    huge = "word " * 2_000_000  # 10 M characters: large, but cheap unless tokenised
    table = pa.table({"text": ["short one", huge, "x" * LIMIT]})
    batch = build_prompts(table, PromptSpec(column="text"), tokenizer, chat=chat, system=None, vocab_size=1024,
                          max_chars=LIMIT)
    assert batch.errors[0] is None and batch.token_ids[0]
    assert batch.errors[1].startswith("prompt has 10,000,000 characters") and batch.token_ids[1] is None
    assert max(tokenizer.encoded) < len(huge)
    if chat:  # the rendered text adds the template's tokens: the row at the limit no longer fits
        assert batch.errors[2] is not None and "not tokenised" in batch.errors[2]
    else:
        assert batch.errors[2] is None


def test_prepared_jobs_carry_the_limit_from_the_checkpoint_when_max_model_len_is_not_set(tmp_path, checkpoint):
    write_parquet(rag_table(3), tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint))])
    job = prepare_job(load_job_file(tmp_path / "jobs.yaml").jobs[0])
    assert job.max_prompt_chars == prompt_char_limit(4096)  # the demo config's max_position_embeddings


def test_a_planned_row_over_the_limit_is_an_error_row_in_both_planners(tmp_path, checkpoint):
    from batchinfer.jobs.run.planning import plan_job, plan_job_globally

    table = rag_table(4)
    documents = table["document"].to_pylist()
    documents[1] = "d" * (LIMIT + 1)
    write_parquet(table.set_column(1, "document", pa.array(documents)), tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint), engine={"max_model_len": MAX_MODEL_LEN})])
    job = prepare_job(load_job_file(tmp_path / "jobs.yaml").jobs[0])
    plan = plan_job(job)
    assert plan.rows == 4 and plan.error_rows == 1
    (tmp_path / "scratch").mkdir()
    summary = plan_job_globally(job, scratch_dir=tmp_path / "scratch").summary
    assert summary.rows == 4 and summary.error_rows == 1


def test_an_openai_request_line_over_the_limit_is_its_error_line(tmp_path, checkpoint):
    from batchinfer.jobs.formats.openai_batch import read_batch_file

    tokenizer = CountingTokenizer(CheckpointTokenizer.from_checkpoint(checkpoint))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(
        f'{{"custom_id": "{i}", "method": "POST", "url": "/v1/completions", "body": {{"prompt": "{text}"}}}}\n'
        for i, text in enumerate(["short", "w" * (LIMIT + 1)])))
    table = read_batch_file(requests, tokenizer, max_chars=LIMIT)
    assert table["request_error"].to_pylist()[0] is None
    assert table["request_error"].to_pylist()[1].startswith(f"prompt has {LIMIT + 1:,} characters")
    assert max(tokenizer.encoded) <= LIMIT
