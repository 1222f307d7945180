"""JSON schemas are strict by default (xgrammar's strict mode, OpenAI's strict structured outputs): an
object without `additionalProperties` admits no other key, at every nesting level; the job's
`sampling.json_schema_strict: false` and a batch line's `response_format.json_schema.strict: false`
leave it open as JSON Schema does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.tasks.grammar_rows import RowGrammars
from batchinfer.jobs.formats.openai_batch import parse_line
from batchinfer.jobs.tasks.schema_strict import strict_schema
from batchinfer.jobs.spec.job_file import parse_job_file
from batchinfer.jobs.tasks.structured import compile_grammar
from batchinfer.jobs.spec.task import GrammarSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from tests.jobs_fixtures import make_tokenizer_checkpoint

VOCAB = 1024
NESTED = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "inner": {"type": "object", "properties": {"b": {"type": "integer"}},
                                                     "required": ["b"]}},
          "required": ["a", "inner"], "additionalProperties": False}  # closed at the top, open inside
EXTRA_INSIDE = '{"a":1,"inner":{"b":2,"x":3}}'
PLAIN = '{"a":1,"inner":{"b":2}}'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> CheckpointTokenizer:
    return CheckpointTokenizer.from_checkpoint(make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt")))


def matches(grammar, tokenizer, text: str) -> bool:
    """Whether the matcher takes every token of `text` and may end there."""
    matcher = grammar.matcher()
    return all(matcher.accept(token) for token in tokenizer.encode_batch([text], add_special_tokens=False)[0]) \
        and matcher.accepting


def job_grammar(sampling: str) -> GrammarSpec:
    text = (f"jobs:\n  - name: s\n    model: demo\n    input: d.parquet\n    prompt: {{column: q}}\n"
            f"    sampling: {sampling}\n")
    return parse_job_file(text, Path("/p/jobs.yaml")).jobs[0].task.grammar


def test_an_extra_nested_key_is_refused_by_default_and_accepted_with_the_opt_out(tokenizer):
    strict = job_grammar(f"{{json_schema: {json.dumps(NESTED)}}}")
    assert strict.strict
    opted_out = job_grammar(f"{{json_schema: {json.dumps(NESTED)}, json_schema_strict: false}}")
    assert not opted_out.strict
    closed, open_ = (compile_grammar(spec, tokenizer, VOCAB) for spec in (strict, opted_out))
    assert matches(closed, tokenizer, PLAIN) and matches(open_, tokenizer, PLAIN)
    assert not matches(closed, tokenizer, EXTRA_INSIDE)
    assert matches(open_, tokenizer, EXTRA_INSIDE)
    # What the schema says stands: an explicit open object stays open.
    explicit = json.loads(json.dumps(NESTED))
    explicit["properties"]["inner"]["additionalProperties"] = True
    assert matches(compile_grammar(GrammarSpec("json_schema", json.dumps(explicit)), tokenizer, VOCAB),
                   tokenizer, EXTRA_INSIDE)


def test_a_schema_columns_rows_follow_the_jobs_strictness(tokenizer):
    for sampling, accepted in (("{json_schema_column: s}", False),
                               ("{json_schema_column: s, json_schema_strict: false}", True)):
        text = f"jobs:\n  - name: s\n    model: demo\n    input: d.parquet\n    prompt: {{column: q}}\n" \
               f"    sampling: {sampling}\n"
        spec = parse_job_file(text, Path("/p/jobs.yaml")).jobs[0]
        grammar, error = RowGrammars(spec, tokenizer, VOCAB).for_row(json.dumps(NESTED))
        assert error is None and matches(grammar, tokenizer, EXTRA_INSIDE) == accepted


def test_a_batch_lines_strict_flag_opens_its_schema():
    def schema_of(json_schema: dict) -> dict:
        body = {"messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": json_schema}}
        line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}
        return json.loads(parse_line(json.dumps(line))["response_schema"])

    assert schema_of({"name": "x", "schema": NESTED}) == strict_schema(NESTED)
    assert schema_of({"name": "x", "schema": NESTED, "strict": True}) == strict_schema(NESTED)
    assert schema_of({"name": "x", "schema": NESTED, "strict": False}) == NESTED
    assert strict_schema(NESTED)["properties"]["inner"]["additionalProperties"] is False


def test_strict_schema_closes_every_level_and_leaves_what_the_schema_says():
    schema = {"type": "object", "properties": {
        "list": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"p": {}}}, {"type": "string"}]},
        "free": {"type": "object", "additionalProperties": {"type": "object", "properties": {"q": {}}}},
        "merged": {"allOf": [{"properties": {"m": {}}}, {"properties": {"n": {"type": "object"}}}]},
        "ref": {"$ref": "#/$defs/thing"}},
        "$defs": {"thing": {"type": "object", "properties": {"t": {}}}}}
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["list"]["items"]["additionalProperties"] is False
    assert strict["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["either"]["anyOf"][1]
    assert strict["properties"]["free"]["additionalProperties"]["additionalProperties"] is False
    assert all("additionalProperties" not in member for member in strict["properties"]["merged"]["allOf"])
    assert strict["properties"]["merged"]["allOf"][1]["properties"]["n"]["additionalProperties"] is False
    assert strict["$defs"]["thing"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy: the job's own schema is not changed


@pytest.mark.parametrize("sampling, message", [
    ("{regex: 'a+', json_schema_strict: false}", "applies to sampling.json_schema or json_schema_column only"),
    ("{json_schema_strict: false}", "applies to sampling.json_schema or json_schema_column only"),
    ("{json_schema: {type: object}, json_schema_strict: 'no'}", "must be true or false"),
])
def test_the_opt_out_is_checked(sampling, message):
    with pytest.raises(JobError, match=message):
        job_grammar(sampling)
