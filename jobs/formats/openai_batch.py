"""OpenAI batch files: request lines in as input rows, batch output lines out from the parts.

In: `input: requests.jsonl`, one request per line (`custom_id`, `method: POST`, `url`
`/v1/chat/completions` or `/v1/completions`, `body`). `read_batch_file` parses it with the
stdlib json parser into an Arrow table of one row per (line, choice): a line with `n: k` is k
rows with the same prompt, which the planner shares as it shares n samples (k − 1 reuse the
prompt), and whose `seed_key`s differ so their samples do. Chat lines are rendered through the
checkpoint's chat template, completion lines tokenised as plain prompts. A line that cannot run
(invalid JSON, no custom_id, a custom_id seen before, an unsupported url or body field) is one
row with its `request_error` and becomes an error line of the output, never a job failure. The
table is held in memory: a batch file is bounded (OpenAI's limit is 50,000 lines, 200 MB).

Per line sampling: the body's max_tokens / max_completion_tokens, temperature, top_p, seed,
stop (and the vLLM extensions top_k, min_p, repetition_penalty) override the job's sampling
values; `row_sampling` turns a table's columns into one `SamplingParams` per row (the engine's
`Request` carries its own).

Out (`output.format: openai`): the parts, rewritten in input order as for `output.order: input`,
are read in order and each line's rows become one output line (`id`, `custom_id`, `response:
{status_code, request_id, body}` with a chat.completion or text_completion body incl. `usage`,
`error`), written once the job is complete to `_batch_output.jsonl` through a temporary name and
a rename, so after a kill and a rerun it holds each line exactly once (the parts hold each
(line, choice) once). The underscore keeps Parquet dataset readers of the folder off it.

Errors (`output.error_form`): `openai` (default) as OpenAI's Batch API writes them: a failed line goes
to the error file `_batch_errors.jsonl` (written before the output file, only when a line failed) as
`response: {status_code: 400, request_id, body: {error: {message, type, param, code}}}, error: null`,
and the output file holds the lines that ran. `vllm` as vLLM's `run-batch` writes them: every line in
the one output file, a failed one as `response: {status_code: 400, request_id, body: null}` with
`error: {error: {message, type: BadRequestError, param, code: 400}}` (its ErrorResponse), ids
`vllm-...` / `vllm-batch-...`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import jinja2
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.engine.types import SamplingParams
from batchinfer.jobs.inputs.remote import fetch_inputs
from batchinfer.jobs.spec.urls import is_url
from batchinfer.jobs.outdir.atomic_files import write_atomically
from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.inputs.files import InputFiles
from batchinfer.jobs.outdir.part_store import scan_parts
from batchinfer.jobs.inputs.prompts import too_long
from batchinfer.jobs.formats.openai_fields import CHAT, CHAT_URL, TEXT, LineError, param_of, parse_line
from batchinfer.jobs.spec.checkpoint import checkpoint_fingerprint, resolve_checkpoint
from batchinfer.jobs.spec.job_file import BATCH_ERROR_COLUMN, BATCH_SEED_KEY_COLUMN, BATCH_TOKEN_IDS_COLUMN, JobSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

OUTPUT_NAME = "_batch_output.jsonl"
ERRORS_NAME = "_batch_errors.jsonl"   # error_form openai: the failed lines, as OpenAI's error file
ERROR_FORMS = ("openai", "vllm")
log = logging.getLogger(__name__)

BATCH_SCHEMA = pa.schema([
    ("line", pa.int64()),                  # 1-based line number in the request file
    ("custom_id", pa.string()),
    ("choice_index", pa.int32()),
    ("choices", pa.int32()),               # the line's n
    ("endpoint", pa.string()),             # chat.completion | text_completion (null: unusable line)
    ("model", pa.string()),                # body.model, echoed in the output
    ("max_tokens", pa.int64()),            # the per-line overrides; null: the job's value
    ("temperature", pa.float64()),
    ("top_p", pa.float64()),
    ("top_k", pa.int64()),
    ("min_p", pa.float64()),
    ("repetition_penalty", pa.float64()),
    ("seed", pa.int64()),
    ("stop", pa.list_(pa.string())),
    ("min_tokens", pa.int64()),
    ("ignore_eos", pa.bool_()),
    ("stop_token_ids", pa.list_(pa.int32())),
    ("logprobs_k", pa.int32()),            # top-k logprobs asked for (null: none); output column `logprobs` holds them
    ("response_schema", pa.string()),      # response_format json_schema's schema, JSON text
    (BATCH_TOKEN_IDS_COLUMN, pa.list_(pa.int32())),
    (BATCH_ERROR_COLUMN, pa.string()),
    (BATCH_SEED_KEY_COLUMN, pa.int64()),
])
BATCH_COLUMNS = tuple(BATCH_SCHEMA.names)
SAMPLING_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
                    "min_tokens", "ignore_eos", "stop_token_ids", "logprobs_k")
SAMPLING_FIELD_OF = {"logprobs_k": "logprobs"}  # column → SamplingParams field where the names differ


def _seed_key(custom_id: str, choice: int) -> int:
    """Per (line, choice): choices differ; the same custom_id samples the same in any file position."""
    return zlib.crc32(f"{choice}:{custom_id}".encode())


def _render(fields: dict, tokenizer: CheckpointTokenizer, template_kwargs: Mapping[str, Any]) -> tuple[str, bool]:
    """The prompt text and whether it is chat-rendered (which holds its special tokens already);
    a line's own `chat_template_kwargs` override the job's."""
    if fields["endpoint"] == TEXT:
        return fields["prompt"], False
    if not tokenizer.has_chat_template:
        raise LineError(f"url {CHAT_URL}: the checkpoint has no chat template")
    try:
        return tokenizer.render_messages(fields["messages"], {**template_kwargs, **(fields["template_kwargs"] or {})}), True
    except jinja2.TemplateError as exc:  # templates may reject a conversation via raise_exception
        raise LineError(f"chat template: {exc}") from None
    except TypeError as exc:  # a line's chat_template_kwargs clash with the template's own arguments
        raise LineError(f"body.chat_template_kwargs: {exc}") from None


def read_batch_file(path: Path, tokenizer: CheckpointTokenizer, limit: Optional[int] = None,
                    template_kwargs: Mapping[str, Any] = {}, max_chars: Optional[int] = None) -> pa.Table:
    """The request file's lines (the first `limit` requests) as rows of `BATCH_SCHEMA` (one per
    choice; one per bad line); a prompt longer than `max_chars` is its line's error, not tokenised."""
    requests = 0
    rows: dict[str, list] = {name: [] for name in BATCH_COLUMNS}
    texts: list[tuple[int, str, bool]] = []  # (first row, text, chat) of each line to tokenise
    given: list[tuple[int, list[int]]] = []  # (first row, token ids) of each line that gave its prompt's ids
    seen: set[str] = set()

    def add(line: int, fields: dict, error: Optional[str]) -> None:
        choices = 1 if error else fields["choices"]
        for choice in range(choices):
            for name in BATCH_COLUMNS:
                rows[name].append(fields.get(name))
            rows["line"][-1], rows["choice_index"][-1], rows["choices"][-1] = line, choice, choices
            rows[BATCH_ERROR_COLUMN][-1] = error
            rows[BATCH_SEED_KEY_COLUMN][-1] = _seed_key(fields.get("custom_id") or "", choice)

    with open(path, encoding="utf-8", errors="replace") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue  # blank lines (a trailing newline) are no requests
            if limit is not None and requests >= limit:
                break
            requests += 1
            fields: Optional[dict] = None
            try:
                fields = parse_line(text)
                if fields["custom_id"] in seen:
                    raise LineError(f"custom_id {fields['custom_id']!r}: duplicate of an earlier line")
                seen.add(fields["custom_id"])
                if fields.get("prompt_ids") is None:
                    prompt, chat = _render(fields, tokenizer, template_kwargs)
                    if max_chars is not None and len(prompt) > max_chars:
                        raise LineError(too_long(prompt, max_chars))
            except LineError as exc:
                custom_id = fields["custom_id"] if fields is not None else getattr(exc, "custom_id", None)
                add(line, {"custom_id": custom_id}, str(exc))
                continue
            for warning in fields["warnings"]:
                log.warning("%s line %d (custom_id %r): %s", display_path(path), line, fields["custom_id"], warning)
            if fields.get("prompt_ids") is not None:
                given.append((len(rows["line"]), fields["prompt_ids"]))
            else:
                texts.append((len(rows["line"]), prompt, chat))
            add(line, fields, None)
    ids: list[Optional[list[int]]] = [None] * len(rows["line"])
    for chat in (False, True):  # chat-rendered text holds its special tokens: encoded without adding more
        batch = [(first, text) for first, text, is_chat in texts if is_chat == chat]
        for (first, _), encoded in zip(batch, tokenizer.encode_batch([t for _, t in batch],
                                                                       add_special_tokens=not chat)):
            for row in range(first, first + rows["choices"][first]):
                ids[row] = encoded
    for first, encoded in given:
        for row in range(first, first + rows["choices"][first]):
            ids[row] = encoded
    for row, encoded in enumerate(ids):
        if encoded is not None and not encoded:
            rows[BATCH_ERROR_COLUMN][row] = "empty prompt"
    rows[BATCH_TOKEN_IDS_COLUMN] = ids
    return pa.table({name: pa.array(values, type=BATCH_SCHEMA.field(name).type) for name, values in rows.items()},
                    schema=BATCH_SCHEMA)


def row_sampling(spec: JobSpec, table: pa.Table) -> Optional[list[SamplingParams]]:
    """One SamplingParams per row of a batch input's `table` (the job's, with the line's overrides);
    None when the job's sampling holds for every row (not a batch input). Equal rows share one
    object: the sampler tables its parameters per distinct object."""
    if BATCH_ERROR_COLUMN not in table.column_names or spec.prompt.error_column != BATCH_ERROR_COLUMN:
        return None
    base = spec.sampling
    columns = [table[name].to_pylist() for name in SAMPLING_COLUMNS]
    shared: dict[tuple, SamplingParams] = {}
    result = []
    for values in zip(*columns):
        key = tuple(tuple(v) if isinstance(v, list) else v for v in values)
        params = shared.get(key)
        if params is None:
            overrides = {SAMPLING_FIELD_OF.get(name, name): value for name, value in zip(SAMPLING_COLUMNS, key)
                         if value is not None}
            max_tokens = overrides.get("max_tokens", base.max_tokens)
            if overrides.get("min_tokens", base.min_tokens) > max_tokens:  # never past the line's budget
                overrides["min_tokens"] = max_tokens
            params = shared[key] = replace(base, **overrides)
        result.append(params)
    return result


# ---- output ---------------------------------------------------------------------------------
def _line_id(job: str, line: int) -> str:
    return hashlib.sha256(f"{job}:{line}".encode()).hexdigest()[:24]


def _ids(job: str, line: int, error_form: str) -> tuple[str, str, str]:
    """(ident, line id, request id) of a line: stable across reruns, in the form's prefixes."""
    ident = _line_id(job, line)
    if error_form == "vllm":
        return ident, f"vllm-{ident}", f"vllm-batch-{ident}"
    return ident, f"batch_req_{ident}", f"req_{ident}"


def _error_line(job: str, row: dict, message: str, code: str, param: Optional[str] = None,
                error_form: str = "openai") -> dict:
    """A line that failed with a 400, in OpenAI's form (the error in the response body) or vLLM's (the
    ErrorResponse in `error`, no body); `param`: the field, if one."""
    _, line_id, request_id = _ids(job, row["line"], error_form)
    if error_form == "vllm":
        return {"id": line_id, "custom_id": row["custom_id"],
                "response": {"status_code": 400, "request_id": request_id, "body": None},
                "error": {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}}
    return {"id": line_id, "custom_id": row["custom_id"],
            "response": {"status_code": 400, "request_id": request_id,
                         "body": {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                            "code": code}}},
            "error": None}


def failed(line: dict) -> bool:
    """An output line of a request that did not run (either error form)."""
    return line["response"] is None or line["response"]["status_code"] != 200


def system_fingerprint(model_fingerprint: Mapping[str, Any]) -> str:
    """`fp_batchinfer_` and a short hash of the checkpoint's fingerprint: changes when the model does."""
    digest = hashlib.sha256(json.dumps(model_fingerprint, sort_keys=True, default=str).encode()).hexdigest()
    return f"fp_batchinfer_{digest[:10]}"


def _token_entry(token_text: Callable[[int], str], token: int, logprob: float) -> dict:
    text = token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def choice_logprobs(row: dict, chat: bool, token_text: Callable[[int], str]) -> Optional[dict]:
    """A choice's `logprobs` in OpenAI's shape (chat: `content` entries with top_logprobs;
    completions: tokens / token_logprobs / top_logprobs / text_offset); None when not asked.
    A token's text is its own decoding (a piece of a multi-byte character shows as U+FFFD)."""
    entries = row.get("logprobs")
    if row.get("logprobs_k") is None or entries is None:
        return None
    tokens = row["output_token_ids"]
    if chat:
        content = []
        for token, entry in zip(tokens, entries):
            item = _token_entry(token_text, token, entry["logprob"])
            item["top_logprobs"] = [_token_entry(token_text, t, lp)
                                    for t, lp in zip(entry["top_ids"] or (), entry["top_logprobs"] or ())]
            content.append(item)
        return {"content": content, "refusal": None}
    texts = [token_text(token) for token in tokens]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": [entry["logprob"] for entry in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in zip(entry["top_ids"] or (), entry["top_logprobs"] or ())}
                             for entry in entries],
            "text_offset": offsets}


def output_line(job: str, model: str, rows: list[dict], created: int,
                token_text: Callable[[int], str] = str, fingerprint: Optional[str] = None,
                reasoning: bool = False, error_form: str = "openai") -> dict:
    """One request line's output from its rows (one per choice, in choice order); `model`: the
    model that ran; `token_text` renders a token id for logprobs; `reasoning`: the job splits
    reasoning (a chat message then has `reasoning_content`); `error_form`: openai | vllm (module docstring)."""
    first = rows[0]
    if first[BATCH_ERROR_COLUMN] is not None and first["endpoint"] is None:
        return _error_line(job, first, first[BATCH_ERROR_COLUMN], "invalid_request",
                           param_of(first[BATCH_ERROR_COLUMN]), error_form)
    failed_row = next((row for row in rows if row["finish_reason"] == "error"), None)
    if failed_row is not None:  # e.g. a prompt longer than the model takes
        return _error_line(job, first, failed_row["error"] or "generation failed", "invalid_prompt",
                           error_form=error_form)
    ident, line_id, request_id = _ids(job, first["line"], error_form)
    chat = first["endpoint"] == CHAT
    choices = []
    for row in rows:
        choice: dict[str, Any] = {"index": row["choice_index"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": row["generated_text"]}
            if reasoning or row.get("reasoning_text") is not None:
                choice["message"]["reasoning_content"] = row.get("reasoning_text")
        else:
            choice["text"] = row["generated_text"]
        choice.update(logprobs=choice_logprobs(row, chat, token_text), finish_reason=row["finish_reason"])
        choices.append(choice)
    completion = sum(row["completion_tokens"] for row in rows)
    prompt = first["prompt_tokens"]  # the prompt once, as OpenAI counts it for n choices
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{ident}", "object": first["endpoint"], "created": created,
            "model": model, "system_fingerprint": fingerprint, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": first["cached_tokens"]}}}
    return {"id": line_id, "custom_id": first["custom_id"],
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


OUTPUT_READ_COLUMNS = ("line", "custom_id", "choice_index", "endpoint", "model", BATCH_ERROR_COLUMN,
                       "generated_text", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason",
                       "error", "logprobs_k", "output_token_ids", "logprobs", "reasoning_text")


def _line_groups(parts: list[Path]) -> Iterator[list[dict]]:
    """The parts' rows (in input order) grouped by request line."""
    group: list[dict] = []
    for path in parts:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=list(OUTPUT_READ_COLUMNS)):
            for row in batch.to_pylist():
                if group and row["line"] != group[0]["line"]:
                    if row["line"] < group[0]["line"]:
                        raise RuntimeError(f"{path.name}: parts are not in input order")
                    yield group
                    group = []
                group.append(row)
    if group:
        yield group


def write_batch_output(out_dir: Path, spec: JobSpec, before_commit: Callable[[], None] = lambda: None,
                       tokenizer: Optional[CheckpointTokenizer] = None) -> Path:
    """`_batch_output.jsonl` (and with error_form openai, `_batch_errors.jsonl` of the failed lines) from
    the folder's finished parts, which must be in input order; `tokenizer` renders the tokens of logprobs
    (without one, a token shows as its id)."""
    parts = sorted((path for path, _ in scan_parts(out_dir, verify=False).finished), key=lambda p: p.name)
    model = Path(spec.model).name  # the checkpoint folder's name, or `demo`
    fingerprint = system_fingerprint(checkpoint_fingerprint(resolve_checkpoint(spec)))
    created = int(time.time())
    target = out_dir / OUTPUT_NAME
    token_text: Callable[[int], str] = str
    if tokenizer is not None:
        def token_text(token: int) -> str:
            return tokenizer.tokenizer.decode([token], skip_special_tokens=False)

    error_form = spec.output.error_form
    errors = out_dir / ERRORS_NAME

    def lines(want_failed: Optional[bool]) -> Iterator[dict]:
        for rows in _line_groups(parts):
            line = output_line(spec.name, model, rows, created, token_text, fingerprint, spec.reasoning == "split",
                               error_form)
            if want_failed is None or failed(line) == want_failed:
                yield line

    def writer(want_failed: Optional[bool]) -> Callable[[Path], None]:
        def write(temp: Path) -> None:
            with open(temp, "w", encoding="utf-8") as handle:
                for line in lines(want_failed):
                    handle.write(json.dumps(line, ensure_ascii=False))
                    handle.write("\n")
        return write

    before_commit()
    # The error file first: the output file's presence says the job's lines are all written.
    if error_form == "openai" and any(True for _ in lines(True)):
        write_atomically(errors, writer(True))
    else:
        errors.unlink(missing_ok=True)  # an earlier run's, or the other form's
    write_atomically(target, writer(False if error_form == "openai" else None))
    return target


def open_batch_input(pattern: str, tokenizer: CheckpointTokenizer, job_file: Path, where: str,
                     limit: Optional[int] = None, template_kwargs: Mapping[str, Any] = {},
                     max_chars: Optional[int] = None) -> InputFiles:
    """The request file as the job's input: its rows parsed and held in memory (`InputFiles.table`).
    `limit` counts request lines (so a line keeps all its choices); `PreparedJob.rows` then takes every row.
    `template_kwargs`: the job's `chat_template_kwargs`, for every chat line."""
    if is_url(pattern):  # an object-store URL: read from its local copy (jobs/inputs/remote.py)
        copies = fetch_inputs(pattern, job_file, where)
        if len(copies) != 1:
            raise JobError(job_file, where, f"{pattern}: an OpenAI batch input is one .jsonl object")
        pattern = str(next(iter(copies)))
    path = Path(pattern)
    if not path.is_file():
        raise JobError(job_file, where,
                       f"no such file: {display_path(path)} (an OpenAI batch input is one .jsonl file)")
    try:
        table = read_batch_file(path, tokenizer, limit, template_kwargs, max_chars)
    except OSError as exc:
        raise JobError(job_file, where, f"cannot read {display_path(path)}: {exc.strerror or exc}") from None
    if table.num_rows == 0:
        raise JobError(job_file, where, f"{display_path(path)} has no request lines")
    return InputFiles(paths=(path,), schema=table.schema, num_rows=table.num_rows, table=table)
