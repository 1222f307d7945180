"""Rows to prompt token ids: templates, prompt columns, chat rendering, row-level errors.

Templates become polars expressions (one vectorised string concat per window, not a
Python format call per row); a template without a `{column}` is one constant prompt for
every row. A row that cannot make a prompt (text that is not valid UTF-8, a null template
column, an empty prompt, a malformed token-id list, text too long to fit `max_model_len`) gets
an error message instead of token ids; the runner records it in that row's `error` column and
the rest of the job goes on.

Text longer than `prompt_char_limit(max_model_len)` is refused before it is tokenised: no
tokenizer puts more than `MAX_CHARS_PER_TOKEN` characters in a token, so it cannot fit, and
tokenising it costs ~400 bytes a character (a 50 MB system prompt took 22 GB).
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Optional

import jinja2
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.jobs.spec.job_file import PromptSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer


MAX_CHARS_PER_TOKEN = 64  # generous: BPE vocabularies' longest tokens are runs of spaces or dashes


def prompt_char_limit(max_model_len: int) -> int:
    """The most characters a prompt that fits `max_model_len` tokens can have."""
    return max_model_len * MAX_CHARS_PER_TOKEN


def too_long(text: str, max_chars: int) -> str:
    return (f"prompt has {len(text):,} characters, more than max_model_len x {MAX_CHARS_PER_TOKEN} "
            f"({max_chars:,}) can hold: not tokenised")


def oversized_job_text(spec: PromptSpec, system: Optional[str], max_chars: int) -> Optional[tuple[str, str]]:
    """(key, error) for a job-level text that alone is longer than any prompt can be, else None."""
    constant = "".join(part.literal for part in parse_template(spec.template)) if spec.template is not None else ""
    kwargs_chars = sum(len(value) for _, value in spec.chat_template_kwargs if isinstance(value, str))
    for key, chars in (("system", len(system or "")), ("prompt.template", len(constant)),
                       ("chat_template_kwargs", kwargs_chars)):
        if chars > max_chars:
            return key, (f"has {chars:,} characters, more than max_model_len x {MAX_CHARS_PER_TOKEN} "
                         f"({max_chars:,}) can hold")
    return None


_AS_BYTES = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(), pa.string_view(): pa.binary_view()}


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


def is_text(dtype: pa.DataType) -> bool:
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype)


def template_can_format(dtype: pa.DataType) -> bool:
    """Whether a template can format a column of this type (polars' cast to text, `_template_texts`).

    An allow-list: polars rejects some types only once a window holds data (durations), and
    panics on others (intervals, 256-bit decimals), so probing an empty column is no test.
    """
    if pa.types.is_dictionary(dtype):
        return template_can_format(dtype.value_type)
    if pa.types.is_decimal(dtype):
        return dtype.bit_width <= 128
    return any(is_type(dtype) for is_type in (
        pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean, pa.types.is_null, pa.types.is_date,
        pa.types.is_timestamp, pa.types.is_time, is_text))


def _template_texts(frame: pl.DataFrame, template: str, rows: int) -> tuple[list[Optional[str]], list[Optional[str]]]:
    columns = template_columns(template)
    if not columns:  # a constant prompt: concat_str of literals alone would make one row, not `rows`
        text = "".join(part.literal for part in parse_template(template))
        return [text] * rows, [None] * rows
    pieces: list[pl.Expr] = []
    for part in parse_template(template):
        if part.literal:
            pieces.append(pl.lit(part.literal))
        if part.column is not None:
            pieces.append(pl.col(part.column).cast(pl.Utf8))
    text = pl.concat_str(pieces, ignore_nulls=False)
    # The first null column named in the template explains the row's error.
    error = pl.lit(None, dtype=pl.Utf8)
    for column in reversed(columns):
        error = pl.when(pl.col(column).is_null()).then(pl.lit(f"template column {column!r} is null")).otherwise(error)
    result = frame.select(text.alias("text"), error.alias("error"))
    return result["text"].to_list(), result["error"].to_list()


def _invalid_utf8_rows(chunk: pa.Array) -> list[int]:
    """Offsets of the values of a (decoded) text array that are not valid UTF-8."""
    try:
        chunk.validate(full=True)  # one vectorised pass: the usual case ends here
        return []
    except pa.ArrowInvalid:
        pass
    bad = []
    for offset, value in enumerate(chunk.view(_AS_BYTES[chunk.type]).to_pylist()):
        try:
            if value is not None:
                value.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(offset)
    return bad


def _valid_text(table: pa.Table, columns: list[str]) -> tuple[pa.Table, list[Optional[str]]]:
    """`table` with each value of the text `columns` that is not valid UTF-8 made null, and each row's
    error naming the first such column. Parquet readers do not check UTF-8, and polars panics on it."""
    errors: list[Optional[str]] = [None] * table.num_rows
    for column in dict.fromkeys(columns):
        chunks, start, found = [], 0, False
        for chunk in table[column].chunks:
            if pa.types.is_dictionary(chunk.type) and is_text(chunk.type.value_type):
                chunk = chunk.dictionary_decode()
            bad = _invalid_utf8_rows(chunk) if is_text(chunk.type) else []
            if bad:
                found = True
                for offset in bad:
                    errors[start + offset] = errors[start + offset] or f"column {column!r} is not valid UTF-8"
                keep = np.ones(len(chunk), dtype=bool)
                keep[bad] = False
                chunk = pc.if_else(pa.array(keep), chunk, pa.scalar(None, chunk.type))
            chunks.append(chunk)
            start += len(chunk)
        if found:
            table = table.set_column(table.schema.get_field_index(column), column,
                                     pa.chunked_array(chunks, type=chunks[0].type))
    return table, errors


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


def _bounded(texts: list[Optional[str]], errors: list[Optional[str]],
             max_chars: Optional[int]) -> list[Optional[str]]:
    if max_chars is None:
        return errors
    return [error or (too_long(text, max_chars) if text is not None and len(text) > max_chars else None)
            for text, error in zip(texts, errors)]


def _render_chat(texts: list[Optional[str]], errors: list[Optional[str]], tokenizer: CheckpointTokenizer,
                 system: Optional[str], template_kwargs: dict,
                 max_chars: Optional[int]) -> tuple[list[Optional[str]], list[Optional[str]]]:
    rendered: list[Optional[str]] = []
    rendered_errors: list[Optional[str]] = []
    for text, error in zip(texts, errors):
        if error is None:
            try:
                text = tokenizer.render_chat(text, system, template_kwargs)
            except jinja2.TemplateError as exc:  # raise_exception, or any failure (tokenizer.ChatTemplateError)
                text, error = None, f"chat template: {exc}"
            if text is not None and max_chars is not None and len(text) > max_chars:  # the template adds text
                text, error = None, too_long(text, max_chars)
        rendered.append(text)
        rendered_errors.append(error)
    return rendered, rendered_errors


def prompt_columns(spec: PromptSpec) -> list[str]:
    """The input columns a prompt reads (none for a constant template)."""
    if spec.template is not None:
        return template_columns(spec.template)
    column = spec.column if spec.column is not None else spec.token_ids_column
    assert column is not None
    return [column]


def row_ids(table: pa.Table, id_column: str) -> list:
    """The id column's values, None where its text is not valid UTF-8 (`build_prompts` makes those
    rows errors); `to_pylist` alone raises UnicodeDecodeError on such text."""
    return _valid_text(table.select([id_column]), [id_column])[0][id_column].to_pylist()


def build_prompts(table: pa.Table, spec: PromptSpec, tokenizer: CheckpointTokenizer, chat: bool,
                  system: Optional[str], vocab_size: int, id_column: Optional[str] = None,
                  max_chars: Optional[int] = None) -> PromptBatch:
    """Prompt token ids (or a row error) for every row of one input window.

    Text in the prompt's columns (and in `id_column`, when given) that is not valid UTF-8 makes
    that row an error. Only the prompt's columns are converted to polars: the rest are not read.
    `max_chars` (`PreparedJob.max_prompt_chars`): longer text, as read or chat-rendered, is the
    row's error and is not tokenised.
    """
    columns = prompt_columns(spec)
    checked = columns + ([id_column] if id_column is not None else [])
    selected, text_errors = _valid_text(table.select(list(dict.fromkeys(checked))), checked)
    frame = pl.from_arrow(selected.select(columns), rechunk=False)
    assert isinstance(frame, pl.DataFrame)
    if spec.token_ids_column is not None:
        batch = _token_id_lists(frame, spec.token_ids_column, vocab_size)
        if spec.error_column is not None:  # the row's own error (a bad request line) explains its missing ids
            row_errors = table[spec.error_column].to_pylist()
            batch = PromptBatch(token_ids=[None if own else ids for ids, own in zip(batch.token_ids, row_errors)],
                                errors=[own or error for error, own in zip(batch.errors, row_errors)])
        return PromptBatch(token_ids=[None if text_error else ids for ids, text_error in
                                      zip(batch.token_ids, text_errors)],
                           errors=[text_error or error for error, text_error in zip(batch.errors, text_errors)])
    if spec.template is not None:
        texts, errors = _template_texts(frame, spec.template, table.num_rows)
    else:
        assert spec.column is not None
        texts, errors = _column_texts(frame, spec.column)
    errors = [text_error or error or ("empty prompt" if not text else None)
              for text, error, text_error in zip(texts, errors, text_errors)]
    errors = _bounded(texts, errors, max_chars)
    if chat:
        texts, errors = _render_chat(texts, errors, tokenizer, system, dict(spec.chat_template_kwargs), max_chars)
    good = [i for i, error in enumerate(errors) if error is None]
    good_texts = [texts[i] for i in good]
    # Chat-rendered text already holds its special tokens; transformers encodes it without adding more.
    encoded = tokenizer.encode_batch(good_texts, add_special_tokens=not chat)
    token_ids: list[Optional[list[int]]] = [None] * len(texts)
    for i, ids in zip(good, encoded):
        token_ids[i] = ids
    return PromptBatch(token_ids=token_ids, errors=errors)
