"""Prompt building: templates, prompt columns, token-id columns, chat rendering, row errors."""
from __future__ import annotations

import datetime
import decimal

import pyarrow as pa
import pytest

from batchinfer.jobs.inputs.prompts import build_prompts, parse_template, row_ids, template_can_format, template_columns
from batchinfer.jobs.spec.job_file import PromptSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from tests.jobs_fixtures import make_tokenizer_checkpoint


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return CheckpointTokenizer.from_checkpoint(make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt")))


def test_parse_template_splits_literals_and_columns_and_keeps_escaped_braces():
    parts = parse_template("{{json}} {doc}\n\nQ: {q}{doc}!")
    assert [(p.literal, p.column) for p in parts] == [("{json} ", "doc"), ("\n\nQ: ", "q"), ("", "doc"), ("!", None)]
    assert template_columns("{doc} {q} {doc}") == ["doc", "q"]


@pytest.mark.parametrize("template", ["{}", "{0}", "{doc.attr}", "{doc[0]}", "{doc!r}", "{doc:>10}", "{doc"])
def test_parse_template_rejects_what_is_not_a_column_reference(template):
    with pytest.raises(ValueError):
        parse_template(template)


def test_template_prompts_match_python_format_and_null_columns_are_row_errors(tokenizer):
    table = pa.table({"doc": ["alpha", None, "gamma", "delta"], "q": ["one?", "two?", None, "four?"],
                      "num": [1, 2, 3, None]})
    template = "{doc}\n\nQuestion {num}: {q}\nAnswer:"
    batch = build_prompts(table, PromptSpec(template=template), tokenizer, chat=False, system=None, vocab_size=1024)
    assert batch.errors == [None, "template column 'doc' is null", "template column 'q' is null",
                            "template column 'num' is null"]
    expected = template.format(doc="alpha", num=1, q="one?")
    assert batch.token_ids[0] == tokenizer.encode_batch([expected])[0]
    assert tokenizer.decode(batch.token_ids[0]) == expected
    assert batch.token_ids[1:] == [None, None, None]


def test_prompt_column_with_null_and_empty_rows(tokenizer):
    table = pa.table({"text": ["hello there", None, "", "bye"]})
    batch = build_prompts(table, PromptSpec(column="text"), tokenizer, chat=False, system=None, vocab_size=1024)
    assert batch.errors == [None, "prompt column 'text' is null", "empty prompt", None]
    assert [tokenizer.decode(ids) for ids in (batch.token_ids[0], batch.token_ids[3])] == ["hello there", "bye"]


def test_token_id_column_is_used_as_is_and_bad_lists_are_row_errors(tokenizer):
    table = pa.table({"ids": pa.array([[5, 6, 7], None, [], [1, 2000], [9]], type=pa.list_(pa.int64()))})
    batch = build_prompts(table, PromptSpec(token_ids_column="ids"), tokenizer, chat=False, system=None,
                          vocab_size=1024)
    assert batch.token_ids == [[5, 6, 7], None, None, None, [9]]
    assert batch.errors == [None, "token_ids column 'ids' is null", "empty prompt",
                            "token ids must be in [0, 1024)", None]


def test_chat_prompts_render_through_the_template_and_add_no_extra_special_tokens(tokenizer):
    table = pa.table({"text": ["What is a state?", "Why?"]})
    batch = build_prompts(table, PromptSpec(column="text"), tokenizer, chat=True, system="Be brief.",
                          vocab_size=1024)
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is a state?<|im_end|>\n" \
               "<|im_start|>assistant\n"
    assert batch.token_ids[0] == tokenizer.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert batch.token_ids[0][0] == tokenizer.tokenizer.token_to_id("<|im_start|>")
    assert batch.errors == [None, None]


def test_chat_templates_with_generation_blocks_compile_and_render_their_body():
    from batchinfer.jobs.inputs.tokenizer import compile_chat_template

    template = compile_chat_template(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>{% endgeneration %}"
        "{% else %}[{{ m.content }}]{% endif %}{% endfor %}")
    assert template.render(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) \
        == "[q]<a>"


def not_utf8(values: list) -> pa.Array:
    """A string array holding the given bytes as they are (as a Parquet file may hold them)."""
    return pa.array(values, pa.binary()).view(pa.string())


def test_a_template_without_columns_is_the_same_prompt_for_every_row(tokenizer):
    table = pa.table({"doc": ["a", None, "c", "d"]})
    batch = build_prompts(table, PromptSpec(template="Write a poem about {{braces}}."), tokenizer, chat=False,
                          system=None, vocab_size=1024)
    expected = tokenizer.encode_batch(["Write a poem about {braces}."])[0]
    assert batch.token_ids == [expected] * 4 and batch.errors == [None] * 4


def test_text_that_is_not_utf8_is_that_rows_error_and_the_other_rows_build(tokenizer):
    table = pa.table({"doc": not_utf8([b"alpha", b"\xff\xfe", b"gamma", None]),
                      "q": not_utf8([b"one?", b"two?", b"bad \xc3", b"four?"]),
                      "unused": not_utf8([b"\xff"] * 4)})  # not read by the prompt: no error, no panic
    batch = build_prompts(table, PromptSpec(template="{doc} {q}"), tokenizer, chat=False, system=None,
                          vocab_size=1024)
    assert batch.errors == [None, "column 'doc' is not valid UTF-8", "column 'q' is not valid UTF-8",
                            "template column 'doc' is null"]
    assert batch.token_ids[0] == tokenizer.encode_batch(["alpha one?"])[0] and batch.token_ids[1:] == [None] * 3
    column = build_prompts(table, PromptSpec(column="q"), tokenizer, chat=False, system=None, vocab_size=1024)
    assert column.errors == [None, None, "column 'q' is not valid UTF-8", None]


def test_not_utf8_is_found_in_every_chunk_dictionary_and_large_text(tokenizer):
    chunked = pa.chunked_array([not_utf8([b"ok", b"fine"]), not_utf8([b"ok", b"\x80"])])
    dictionary = not_utf8([b"x", b"\xfe", b"x"]).dictionary_encode()
    table = pa.table({"a": chunked, "b": pa.chunked_array([dictionary, not_utf8([b"y"]).dictionary_encode()]),
                      "c": pa.array([b"1", b"2", b"\xff", b"4"], pa.large_binary()).view(pa.large_string())})
    errors = build_prompts(table, PromptSpec(template="{a}{b}{c}"), tokenizer, chat=False, system=None,
                           vocab_size=1024).errors
    assert errors == [None, "column 'b' is not valid UTF-8", "column 'c' is not valid UTF-8",
                      "column 'a' is not valid UTF-8"]


def test_an_id_column_that_is_not_utf8_is_a_row_error_and_its_ids_read_as_none(tokenizer):
    table = pa.table({"uid": not_utf8([b"r0", b"\xff", b"r2"]),
                      "ids": pa.array([[5], [6], [7]], type=pa.list_(pa.int64()))})
    batch = build_prompts(table, PromptSpec(token_ids_column="ids"), tokenizer, chat=False, system=None,
                          vocab_size=1024, id_column="uid")
    assert batch.token_ids == [[5], None, [7]] and batch.errors == [None, "column 'uid' is not valid UTF-8", None]
    assert row_ids(table, "uid") == ["r0", None, "r2"]


FORMATTED = [  # (arrow array of one value, the text a template puts in its place)
    (pa.array([7]), "7"), (pa.array([-3], pa.int8()), "-3"),
    (pa.array([2**64 - 1], pa.uint64()), "18446744073709551615"),
    (pa.array([1.0]), "1.0"), (pa.array([0.1], pa.float32()), "0.1"), (pa.array([1e20]), "1e+20"),
    (pa.array([True]), "true"), (pa.array([datetime.date(2024, 1, 2)]), "2024-01-02"),
    (pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5)]), "2024-01-02 03:04:05.000000"),
    (pa.array([datetime.time(1, 2, 3)]), "01:02:03"), (pa.array([decimal.Decimal("1.50")]), "1.50"),
    (pa.array(["x"]).dictionary_encode(), "x"), (pa.array(["L"], pa.large_string()), "L"),
]


@pytest.mark.parametrize("values, text", FORMATTED, ids=[str(values.type) for values, _ in FORMATTED])
def test_template_values_are_formatted_as_the_readme_says(tokenizer, values, text):
    assert template_can_format(values.type)
    batch = build_prompts(pa.table({"v": values}), PromptSpec(template="<{v}>"), tokenizer, chat=False,
                          system=None, vocab_size=1024)
    assert tokenizer.decode(batch.token_ids[0]) == f"<{text}>"


@pytest.mark.parametrize("dtype", [pa.duration("us"), pa.month_day_nano_interval(), pa.decimal256(40, 2),
                                   pa.binary(), pa.binary(4), pa.large_binary(), pa.list_(pa.int64()),
                                   pa.struct([("a", pa.int64())]), pa.dictionary(pa.int32(), pa.binary())])
def test_types_polars_cannot_format_are_refused_before_a_window_is_read(dtype):
    assert not template_can_format(dtype)
