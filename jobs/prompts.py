"""Rows to prompt token ids: templates, prompt columns, chat rendering, row-level errors.

Templates become polars expressions (one vectorised string concat per window, not a
Python format call per row). A row that cannot make a prompt (a null template column,
an empty prompt, a malformed token-id list) gets an error message instead of token ids;
the runner records it in that row's `error` column and the rest of the job goes on.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Optional

import jinja2
import polars as pl
import pyarrow as pa

from jobs.spec import PromptSpec
from jobs.tokenizer import CheckpointTokenizer


@dataclass(frozen=True)
class TemplatePart:
    literal: str
    column: Optional[str]  # None for trailing literal text


@dataclass(frozen=True)
class PromptBatch:
    """One window's prompts: token ids, or an error, per row (same order as the rows)."""

    token_ids: list[Optional[list[int]]]
    errors: list[Optional[str]]


def parse_template(template: str) -> list[TemplatePart]:
    """Split "{document}\\n\\nQ: {question}" into literal text and column names.

    Raises ValueError for what str.format allows but a column reference cannot be:
    positional fields, attribute/index access, conversions and format specs.
    """
    parts = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"malformed template: {exc}") from None
    pending_literal = ""  # the parser splits literal text at escaped braces; join it back
    for literal, field, spec, conversion in parsed:
        pending_literal += literal
        if field is None:
            continue
        if not field or any(c in field for c in ".[") or field.isdigit():
            raise ValueError(f"template field {{{field}}} must name a column")
        if spec or conversion:
            raise ValueError(f"template field {{{field}}} cannot have a conversion or format spec")
        parts.append(TemplatePart(literal=pending_literal, column=field))
        pending_literal = ""
    if pending_literal:
        parts.append(TemplatePart(literal=pending_literal, column=None))
    return parts


def template_columns(template: str) -> list[str]:
    return list(dict.fromkeys(part.column for part in parse_template(template) if part.column is not None))


def _template_texts(frame: pl.DataFrame, template: str) -> tuple[list[Optional[str]], list[Optional[str]]]:
    pieces: list[pl.Expr] = []
    for part in parse_template(template):
        if part.literal:
            pieces.append(pl.lit(part.literal))
        if part.column is not None:
            pieces.append(pl.col(part.column).cast(pl.Utf8))
    text = pl.concat_str(pieces, ignore_nulls=False) if pieces else pl.lit("")
    # The first null column named in the template explains the row's error.
    error = pl.lit(None, dtype=pl.Utf8)
    for column in reversed(template_columns(template)):
        error = pl.when(pl.col(column).is_null()).then(pl.lit(f"template column {column!r} is null")).otherwise(error)
    result = frame.select(text.alias("text"), error.alias("error"))
    return result["text"].to_list(), result["error"].to_list()


def _column_texts(frame: pl.DataFrame, column: str) -> tuple[list[Optional[str]], list[Optional[str]]]:
    texts = frame[column].to_list()
    return texts, [f"prompt column {column!r} is null" if text is None else None for text in texts]


def _token_id_lists(frame: pl.DataFrame, column: str, vocab_size: int) -> PromptBatch:
    token_ids: list[Optional[list[int]]] = []
    errors: list[Optional[str]] = []
    for ids in frame[column].to_list():
        error = None
        if ids is None:
            error = f"token_ids column {column!r} is null"
        elif not ids:
            error = "empty prompt"
        elif any(i is None or not 0 <= i < vocab_size for i in ids):
            error = f"token ids must be in [0, {vocab_size})"
        token_ids.append(None if error else list(ids))
        errors.append(error)
    return PromptBatch(token_ids=token_ids, errors=errors)


def _render_chat(texts: list[Optional[str]], errors: list[Optional[str]], tokenizer: CheckpointTokenizer,
                 system: Optional[str]) -> tuple[list[Optional[str]], list[Optional[str]]]:
    rendered: list[Optional[str]] = []
    rendered_errors: list[Optional[str]] = []
    for text, error in zip(texts, errors):
        if error is None:
            try:
                text = tokenizer.render_chat(text, system)
            except jinja2.TemplateError as exc:  # templates may reject a conversation via raise_exception
                text, error = None, f"chat template: {exc}"
        rendered.append(text)
        rendered_errors.append(error)
    return rendered, rendered_errors


def build_prompts(table: pa.Table, spec: PromptSpec, tokenizer: CheckpointTokenizer, chat: bool,
                  system: Optional[str], vocab_size: int) -> PromptBatch:
    """Prompt token ids (or a row error) for every row of one input window."""
    frame = pl.from_arrow(table, rechunk=False)
    assert isinstance(frame, pl.DataFrame)
    if spec.token_ids_column is not None:
        return _token_id_lists(frame, spec.token_ids_column, vocab_size)
    if spec.template is not None:
        texts, errors = _template_texts(frame, spec.template)
    else:
        assert spec.column is not None
        texts, errors = _column_texts(frame, spec.column)
    errors = [error or ("empty prompt" if not text else None) for text, error in zip(texts, errors)]
    if chat:
        texts, errors = _render_chat(texts, errors, tokenizer, system)
    good = [i for i, error in enumerate(errors) if error is None]
    good_texts = [texts[i] for i in good]
    # Chat-rendered text already holds its special tokens; transformers encodes it without adding more.
    encoded = tokenizer.encode_batch(good_texts, add_special_tokens=not chat)
    token_ids: list[Optional[list[int]]] = [None] * len(texts)
    for i, ids in zip(good, encoded):
        token_ids[i] = ids
    return PromptBatch(token_ids=token_ids, errors=errors)
