"""Chat templates with thinking branches render as transformers renders them, with chat_template_kwargs.

The template below is written for these tests with the thinking branches of the official Qwen3.5
template: the generation prompt opens a reasoning block (`<think>\\n`) unless `enable_thinking` is
false, which writes an empty closed block instead; an optional system message comes first.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.inputs.prompts import build_prompts
from batchinfer.jobs.spec.job_file import PromptSpec, load_job_file
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, write_job_file

THINKING_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip() + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""


def make_thinking_checkpoint(folder: Path) -> Path:
    """The tokenizer checkpoint of tests/jobs_fixtures.py with the thinking template above."""
    checkpoint = make_tokenizer_checkpoint(folder)
    (checkpoint / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    return checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(checkpoint))


CASES = [(kwargs, system) for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False})
         for system in (None, "You answer in one word.")]


@pytest.mark.parametrize("kwargs, system", CASES)
def test_thinking_branches_render_and_tokenise_as_transformers_does(checkpoint, hf_tokenizer, kwargs, system):
    user = "What is the capital of France?"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    expected_text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    expected_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False, **kwargs)
    tokenizer = CheckpointTokenizer.from_checkpoint(checkpoint)
    assert tokenizer.render_chat(user, system, kwargs) == expected_text
    spec = PromptSpec(column="text", chat_template_kwargs=tuple(kwargs.items()))
    batch = build_prompts(pa.table({"text": [user]}), spec, tokenizer, chat=True, system=system, vocab_size=1024)
    assert batch.token_ids == [list(expected_ids)]
    thinking = kwargs.get("enable_thinking", True)  # the template's default: thinking on
    assert expected_text.endswith("<think>\n" if thinking else "<think>\n\n</think>\n\n")


def test_any_template_variable_can_be_passed_and_overrides_a_special_token(tmp_path, hf_tokenizer):
    checkpoint = make_tokenizer_checkpoint(tmp_path / "ckpt")
    (checkpoint / "chat_template.jinja").write_text(
        "{{ eos_token }}|{{ persona }}|{{ messages[0].content }}|{{ add_generation_prompt }}")
    tokenizer = CheckpointTokenizer.from_checkpoint(checkpoint)
    rendered = tokenizer.render_chat("hi", None, {"persona": "pirate", "eos_token": "<END>"})
    assert rendered == "<END>|pirate|hi|True"


def _job(tmp_path: Path, checkpoint: Path, **entry) -> Path:
    return write_job_file(tmp_path, [job_entry(model=str(checkpoint), **entry)])


def test_chat_template_kwargs_are_read_from_the_job_and_defaults(tmp_path, checkpoint):
    job_file = _job(tmp_path, checkpoint, chat=True, chat_template_kwargs={"enable_thinking": False})
    assert load_job_file(job_file).jobs[0].prompt.chat_template_kwargs == (("enable_thinking", False),)
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint))],
                              defaults={"chat": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert load_job_file(job_file).jobs[0].prompt.chat_template_kwargs == (("enable_thinking", False),)


@pytest.mark.parametrize("entry, where, what", [
    ({"chat_template_kwargs": {"enable_thinking": False}}, "jobs.rag.chat_template_kwargs", "needs chat: true"),
    ({"chat": True, "chat_template_kwargs": ["enable_thinking"]}, "jobs.rag.chat_template_kwargs", "must be a mapping"),
    ({"chat": True, "chat_template_kwargs": {"messages": []}}, "jobs.rag.chat_template_kwargs.messages",
     "is set by batchinfer"),
])
def test_bad_chat_template_kwargs_are_one_line_errors(tmp_path, checkpoint, entry, where, what):
    with pytest.raises(JobError) as caught:
        load_job_file(_job(tmp_path, checkpoint, **entry))
    assert caught.value.where == where and what in caught.value.what
