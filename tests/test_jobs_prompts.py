"""Prompt building: templates, prompt columns, token-id columns, chat rendering, row errors."""
from __future__ import annotations

import pyarrow as pa
import pytest

from jobs.prompts import build_prompts, parse_template, template_columns
from jobs.spec import PromptSpec
from jobs.tokenizer import CheckpointTokenizer
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
    from jobs.tokenizer import compile_chat_template

    template = compile_chat_template(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>{% endgeneration %}"
        "{% else %}[{{ m.content }}]{% endif %}{% endfor %}")
    assert template.render(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) \
        == "[q]<a>"
