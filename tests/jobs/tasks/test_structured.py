"""Structured output, grammar side: whatever a sampler picks among the tokens the mask allows, the text
parses and validates (the grammar alone guarantees it, before any engine or model weights)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from batchinfer.jobs.tasks import structured
from batchinfer.jobs.tasks.structured import (GrammarError, allowed_tokens, compile_grammar, fill_masks, new_bitmask)
from batchinfer.jobs.spec.task import GrammarSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from tests.jobs_fixtures import make_tokenizer_checkpoint

jsonschema = pytest.importorskip("jsonschema")

VOCAB = 1024
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "a \"quoted\" one"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "ok": {"type": "boolean"}},
                  "required": ["age", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> CheckpointTokenizer:
    return CheckpointTokenizer.from_checkpoint(make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt")))


def random_masked_text(grammar, tokenizer, rng, budget=600, masked=True):
    """Uniformly random tokens among those the mask allows, until the grammar ends or the budget does."""
    matcher = grammar.matcher()
    bits = new_bitmask(1, VOCAB)
    tokens = []
    for _ in range(budget):
        if matcher.finished:
            return tokenizer.decode(tokens), True
        matcher.fill_mask(bits[0])
        allowed = allowed_tokens(bits[0], VOCAB) if masked else np.arange(VOCAB)
        token = int(rng.choice(allowed))
        if not matcher.accept(token):
            return tokenizer.decode(tokens + [token]), False
        tokens.append(token)
    return tokenizer.decode(tokens), matcher.finished


def test_every_random_masked_json_output_parses_and_validates(tokenizer):
    job = parse_job_file(f"jobs:\n  - name: s\n    model: demo\n    input: d.parquet\n    prompt: {{column: q}}\n"
                         f"    sampling: {{json_schema: {json.dumps(SCHEMA)}}}\n", Path("/p/jobs.yaml")).jobs[0]
    grammar = compile_grammar(job.task.grammar, tokenizer, VOCAB)
    rng = np.random.default_rng(0)
    finished = 0
    for _ in range(40):
        text, done = random_masked_text(grammar, tokenizer, rng)
        if done:
            finished += 1
            jsonschema.validate(json.loads(text), SCHEMA)
            assert list(json.loads(text)) == list(SCHEMA["properties"])  # in the schema's order
    assert finished >= 30  # the budget rarely runs out: the test sees real completions


def test_without_the_mask_random_tokens_break_the_grammar(tokenizer):
    grammar = compile_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)), tokenizer, VOCAB)
    rng = np.random.default_rng(0)
    results = [random_masked_text(grammar, tokenizer, rng, masked=False) for _ in range(10)]
    assert not any(done for _, done in results)  # what the mask prevents: accept() refuses a token


def test_regex_and_choice_outputs_always_match(tokenizer):
    rng = np.random.default_rng(1)
    regex = compile_grammar(GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}( ok)?"), tokenizer, VOCAB)
    choices = ("yes", "no", 'say "maybe" \\ later', "ünïcode")
    choice = compile_grammar(GrammarSpec("choice", choices), tokenizer, VOCAB)
    for _ in range(30):
        text, done = random_masked_text(regex, tokenizer, rng)
        assert done and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}( ok)?", text), text
        text, done = random_masked_text(choice, tokenizer, rng)
        assert done and text in choices, text


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_the_batch_fill_equals_one_row_at_a_time(tokenizer, threads, monkeypatch):
    """Whatever the mask pool's size (BATCHINFER_GRAMMAR_THREADS, read when the pool is built)."""
    if threads is None:
        monkeypatch.delenv("BATCHINFER_GRAMMAR_THREADS", raising=False)
    else:
        monkeypatch.setenv("BATCHINFER_GRAMMAR_THREADS", str(threads))
    monkeypatch.setattr(structured, "_EXECUTOR", None)
    grammar = compile_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)), tokenizer, VOCAB)
    matchers = [grammar.matcher() for _ in range(5)]
    for token in tokenizer.encode_batch(['{"name":"ab'])[0]:
        assert matchers[1].accept(token)
    batch = new_bitmask(5, VOCAB)
    fill_masks(matchers, batch)
    assert structured._EXECUTOR is not None
    for row, matcher in enumerate(matchers):
        single = new_bitmask(1, VOCAB)
        matcher.fill_mask(single[0])
        assert np.array_equal(single[0], batch[row])
    assert not np.array_equal(batch[0], batch[1])
    if threads is not None:
        assert structured.mask_threads() == threads


def test_the_mask_pool_defaults_to_every_usable_cpu(monkeypatch):
    import os

    monkeypatch.delenv("BATCHINFER_GRAMMAR_THREADS", raising=False)
    assert structured.mask_threads() == min(32, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("value", ["0", "many", "-2"])
def test_a_bad_thread_count_is_one_line(value, monkeypatch):
    monkeypatch.setenv("BATCHINFER_GRAMMAR_THREADS", value)
    with pytest.raises(GrammarError, match="BATCHINFER_GRAMMAR_THREADS must be a positive integer"):
        structured.mask_threads()


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", json.dumps({"type": "objectx"})), "objectx"),
    (GrammarSpec("regex", "[a-"), "unclosed character class"),
])
def test_a_constraint_that_cannot_compile_is_one_line(tokenizer, spec, message):
    with pytest.raises(GrammarError) as caught:
        compile_grammar(spec, tokenizer, VOCAB)
    assert message in str(caught.value) and "\n" not in str(caught.value)


# ---- the job-file side: shapes at parse, compiling at prepare, then "not supported yet" ----------
from pathlib import Path  # noqa: E402

import pyarrow as pa  # noqa: E402

from batchinfer.jobs.errors import JobError  # noqa: E402
from batchinfer.jobs.run.prepare import prepare_job  # noqa: E402
from batchinfer.jobs.spec.job_file import load_job_file, parse_job_file  # noqa: E402
from tests.jobs_fixtures import job_entry, write_job_file, write_parquet  # noqa: E402


@pytest.mark.parametrize("sampling, where, what", [
    ("{logprobs: -1}", "sampling.logprobs", "must be >= 0"),
    ("{logprobs: 21}", "sampling.logprobs", "must be <= 20"),
    ("{logprobs: true}", "sampling.logprobs", "must be an integer"),
    ("{choice: []}", "sampling.choice", "non-empty list"),
    ("{choice: [a, a]}", "sampling.choice", "twice"),
    ("{regex: ''}", "sampling.regex", "non-empty string"),
    ("{json_schema: [1]}", "sampling.json_schema", "must be a JSON schema"),
    ("{json_schema: '{bad'}", "sampling.json_schema", "not valid JSON"),
    ("{json_schema: {type: object}, regex: 'a'}", "sampling.regex", "cannot be given with sampling.json_schema"),
])
def test_constraint_and_logprobs_shapes_are_checked_at_parse(sampling, where, what):
    text = f"jobs:\n  - name: s\n    model: demo\n    input: d.parquet\n    prompt: {{column: q}}\n" \
           f"    sampling: {sampling}\n"
    with pytest.raises(JobError) as caught:
        parse_job_file(text, Path("/p/jobs.yaml"))
    assert f"jobs.s.{where}" in str(caught.value) and what in str(caught.value)


def prepare_error(tmp_path, tokenizer_checkpoint, **entry) -> str:
    write_parquet(pa.table({"question": ["q"], "choices": [["a", "b"]]}), tmp_path / "data" / "rag.parquet")
    job_file = write_job_file(tmp_path, [job_entry(model=str(tokenizer_checkpoint), prompt={"template": "{question}"},
                                                   **entry)])
    with pytest.raises(JobError) as caught:
        prepare_job(load_job_file(job_file).jobs[0])
    return str(caught.value)


@pytest.fixture(scope="module")
def tokenizer_checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt2"))


@pytest.mark.parametrize("entry, where, what", [
    ({"sampling": {"json_schema": {"type": "objectx"}}}, "sampling.json_schema", "cannot be compiled: Invalid type"),
    ({"sampling": {"regex": "[a-"}}, "sampling.regex", "cannot be compiled"),
    ({"sampling": {"json_schema_column": "schema"}}, "sampling.json_schema_column", "not in the input"),
    ({"sampling": {"json_schema_column": "choices"}}, "sampling.json_schema_column", "must be text"),
    ({"task": "score", "score": {"continuations_column": "question"},
      "eval": {"answer_column": "choices", "metric": "choice_accuracy"}}, "eval.answer_column",
     "must be an integer index or text"),
])
def test_prepare_compiles_the_grammar_and_refuses_what_the_engine_lacks(tmp_path, tokenizer_checkpoint, entry,
                                                                         where, what):
    message = prepare_error(tmp_path, tokenizer_checkpoint, **entry)
    assert f"jobs.rag.{where}:" in message and what in message and "\n" not in message


def test_prepare_refuses_a_bad_mask_thread_count_before_anything_runs(tmp_path, tokenizer_checkpoint, monkeypatch):
    monkeypatch.setenv("BATCHINFER_GRAMMAR_THREADS", "lots")
    message = prepare_error(tmp_path, tokenizer_checkpoint, sampling={"regex": "[a-z]+"})
    assert "jobs.rag.sampling.regex:" in message and "BATCHINFER_GRAMMAR_THREADS" in message and "\n" not in message
