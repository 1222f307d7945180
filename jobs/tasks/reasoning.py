"""Reasoning blocks: generated `<think>...</think>` text apart from the answer after it.

Qwen3.5's chat template opens the reasoning in the generation prompt (`<think>\\n`) when thinking
is on, and writes an empty closed block (`<think>\\n\\n</think>\\n\\n`) when `enable_thinking` is
false; other templates and models leave the opening tag to the model. So generated text may start
inside the reasoning without an opening tag, and a budget that runs out mid-reasoning leaves no
closing tag. The job decides once, from its rendered prompt, whether generation starts inside a
reasoning block; each output is then split on the tags it holds.

Job setting `reasoning`: `auto` (default) splits when the job renders a chat template that has
thinking tags, `split` always splits, `raw` never does (generated_text is the decoded text as is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jinja2

from batchinfer.jobs.spec.job_file import JobSpec
from batchinfer.jobs.inputs.prepared_job import ReasoningSplit
from batchinfer.jobs.inputs.tokenizer import THINK_CLOSE, THINK_OPEN, CheckpointTokenizer


@dataclass(frozen=True)
class ReasoningParts:
    answer: str                  # the text after the closing tag ("" when it never came)
    reasoning: Optional[str]     # None: the output holds no reasoning block
    truncated: bool              # the output ended inside the reasoning (no closing tag)


def ends_inside_reasoning(prompt: str) -> bool:
    """Whether text generated after `prompt` continues an open reasoning block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def split_reasoning(text: str, starts_inside: bool) -> ReasoningParts:
    """Reasoning and answer of one generated text, with or without the opening and closing tags.

    Whitespace is trimmed as Qwen's templates trim it when they render a past reasoning turn:
    the reasoning stripped, the answer without its leading newlines.
    """
    body = text
    if text.lstrip().startswith(THINK_OPEN):  # the model opened the block itself
        body, starts_inside = text.lstrip()[len(THINK_OPEN):], True
    end = body.find(THINK_CLOSE)
    if end < 0:
        if starts_inside:
            return ReasoningParts(answer="", reasoning=body.strip(), truncated=True)
        return ReasoningParts(answer=text, reasoning=None, truncated=False)
    # A closing tag without an opening one: the prompt opened the block (a pre-rendered prompt column).
    return ReasoningParts(answer=body[end + len(THINK_CLOSE):].lstrip("\n"), reasoning=body[:end].strip(),
                          truncated=False)


def _prompt_probe(spec: JobSpec, tokenizer: CheckpointTokenizer) -> str:
    """The text every prompt of the job ends with, as far as it can be known before reading rows."""
    if spec.chat:
        try:
            return tokenizer.render_chat("probe", spec.system, dict(spec.prompt.chat_template_kwargs))
        except (jinja2.TemplateError, TypeError, ValueError):  # the rows will report it
            return ""
    if spec.prompt.template is not None:
        return spec.prompt.template
    return ""  # prompt columns and token ids: a closing tag in the output still marks the reasoning


def reasoning_split(spec: JobSpec, tokenizer: CheckpointTokenizer) -> ReasoningSplit:
    enabled = spec.reasoning == "split" or (spec.reasoning == "auto" and spec.chat and tokenizer.has_thinking_tags)
    starts_inside = enabled and ends_inside_reasoning(_prompt_probe(spec, tokenizer))
    return ReasoningSplit(enabled=enabled, starts_inside=starts_inside)
