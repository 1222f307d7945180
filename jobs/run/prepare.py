"""Before a job runs: every check that can fail on bad input, leaving nothing behind.

Checkpoint, input files, columns and their types, tokenizer and chat template, whether the
output folder can be written and may be continued: each failure is one `JobError` naming the
job file and key or column, raised before the output folder is touched (and so before any
model loads), in the order a user would fix them. The result, a `PreparedJob`, is what
`runner.run_job` and `planning.plan_job` take.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pyarrow as pa

from batchinfer.jobs.spec.pipeline_fit import check_pipeline
from batchinfer.jobs.spec.checkpoint import check_checkpoint, checkpoint_fingerprint, resolve_checkpoint
from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.inputs.files import input_fingerprint, open_inputs
from batchinfer.jobs.outdir.remote_folder import pull_output
from batchinfer.jobs.outdir.part_writer import RESULT_COLUMNS
from batchinfer.jobs.inputs.prompts import (is_text, oversized_job_text, parse_template, prompt_char_limit,
                                     template_can_format, template_columns)
from batchinfer.jobs.tasks.reasoning import reasoning_split
from batchinfer.jobs.outdir.part_store import PARTS_DIR
from batchinfer.jobs.outdir.resume import MANIFEST_NAME, STATS_NAME, check_resumable
from batchinfer.jobs.spec.sampling_defaults import resolve_sampling
from batchinfer.jobs.spec.job_file import NESTED_OUTPUTS, JobSpec, did_you_mean, openai_batch_input, output_relation
from batchinfer.jobs.formats.openai_batch import open_batch_input
from batchinfer.jobs.tasks.checks import check_task
from batchinfer.jobs.spec.task import TaskSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from batchinfer.jobs.inputs.prepared_job import PreparedJob


def _check_columns(spec: JobSpec, schema: pa.Schema) -> None:
    def require(column: str, key: str) -> pa.DataType:
        if column not in schema.names:
            raise JobError(spec.job_file, spec.where(key),
                           f"column {column!r} is not in the input{did_you_mean(column, schema.names)}")
        return schema.field(column).type

    prompt = spec.prompt
    if prompt.template is not None:
        try:
            parse_template(prompt.template)
        except ValueError as exc:
            raise JobError(spec.job_file, spec.where("prompt.template"), str(exc)) from None
        for column in template_columns(prompt.template):
            dtype = require(column, "prompt.template")
            if not template_can_format(dtype):
                raise JobError(spec.job_file, spec.where("prompt.template"),
                               f"column {column!r} has type {dtype}, which a template cannot format")
    elif prompt.column is not None:
        dtype = require(prompt.column, "prompt.column")
        if not is_text(dtype):
            raise JobError(spec.job_file, spec.where("prompt.column"),
                           f"column {prompt.column!r} must be text, got {dtype}")
    else:
        assert prompt.token_ids_column is not None
        dtype = require(prompt.token_ids_column, "prompt.token_ids_column")
        if not (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) or not pa.types.is_integer(dtype.value_type):
            raise JobError(spec.job_file, spec.where("prompt.token_ids_column"),
                           f"column {prompt.token_ids_column!r} must be a list of integers, got {dtype}")
    if spec.id_column is not None:
        require(spec.id_column, "id_column")
    clashes = [name for name in schema.names if name in RESULT_COLUMNS]
    if clashes:
        raise JobError(spec.job_file, spec.where("input"),
                       f"input column {clashes[0]!r} has the name of an output column")


def _load_tokenizer(checkpoint: Path, spec: JobSpec) -> CheckpointTokenizer:
    try:
        tokenizer = CheckpointTokenizer.from_checkpoint(checkpoint)
    except Exception as exc:  # tokenizers raises bare Exceptions for malformed files
        raise JobError(spec.job_file, spec.where("model"), f"cannot load the tokenizer: {exc}") from None
    if spec.chat and not tokenizer.has_chat_template:
        raise JobError(spec.job_file, spec.where("chat"), "the checkpoint has no chat template")
    return tokenizer


def _check_output(spec: JobSpec) -> None:
    """The output folder is (or can be made) a folder this process can write in, writing nothing, and
    neither lies inside another job's output folder nor holds one (reruns and readers would mix them).

    Checked by writing, not with os.access: a read-only mount, ACLs or root's exemption from
    permission bits make access() answer wrongly; a probe file created and removed is the truth.
    """
    out = spec.output.path

    def fail(what: str) -> JobError:
        return JobError(spec.job_file, spec.where("output"), what)

    nearest = out
    while not os.path.lexists(nearest) and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():  # a file, or a link to nothing
        if nearest == out:
            raise fail(f"{display_path(out)} exists and is not a folder")
        raise fail(f"{display_path(nearest)} is not a folder, so {display_path(out)} cannot be made")
    try:
        handle, probe = tempfile.mkstemp(prefix=".batchinfer-write-check-", dir=nearest)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise fail(f"cannot write in {display_path(nearest)}: {exc.strerror or exc}") from None
    other = _neighbouring_output(out)
    if other is not None:
        raise fail(f"{display_path(out)} {output_relation(out, other)} {display_path(other)}, the output folder of "
                   f"another batchinfer job (it holds {', '.join(_markers(other))}): {NESTED_OUTPUTS}")


# What marks a folder as a batchinfer job's output (manifest, stats, part records).
OUTPUT_MARKERS = (MANIFEST_NAME, STATS_NAME, PARTS_DIR)


def _markers(folder: Path) -> list[str]:
    return [name for name in OUTPUT_MARKERS if os.path.lexists(folder / name)]


def _neighbouring_output(out: Path) -> Optional[Path]:
    """A batchinfer output folder above `out` or below it (its own markers are its own), None if there is none."""
    real = out.resolve()
    for folder in real.parents:
        if _markers(folder):
            return folder
    if real.is_dir():
        for folder, subfolders, _files in os.walk(real):  # links not followed: a link out is not inside
            subfolders.sort()
            if Path(folder) != real and _markers(Path(folder)):
                return Path(folder)
    return None


def prepare_job(spec: JobSpec, overwrite: bool = False) -> PreparedJob:
    """Every bad-input check, in the order a user would fix them; writes nothing."""
    checkpoint = resolve_checkpoint(spec)
    model_config = check_checkpoint(checkpoint, spec)
    check_pipeline(spec, model_config, checkpoint)
    vocab_size = model_config.vocab_size
    max_prompt_chars = prompt_char_limit(spec.engine.max_model_len or model_config.max_position_embeddings)
    sampling = resolve_sampling(spec, checkpoint)
    spec = replace(spec, sampling=sampling.params)
    if openai_batch_input(spec):  # its lines are rendered and tokenised as they are read
        tokenizer = _load_tokenizer(checkpoint, spec)
        inputs = open_batch_input(spec.input, tokenizer, spec.job_file, spec.where("input"), spec.limit,
                                  dict(spec.prompt.chat_template_kwargs), max_prompt_chars)
        spec = replace(spec, limit=None)  # applied to request lines already: every row of the table runs
        _check_columns(spec, inputs.schema)
    else:
        inputs = open_inputs(spec.input, spec.job_file, spec.where("input"), exclude=spec.output.path,
                             input_format=spec.input_format)
        _check_columns(spec, inputs.schema)
        tokenizer = _load_tokenizer(checkpoint, spec)
    oversized = oversized_job_text(spec.prompt, spec.system if spec.chat else None, max_prompt_chars)
    if oversized is not None:
        raise JobError(spec.job_file, spec.where(oversized[0]), oversized[1])
    reasoning = reasoning_split(spec, tokenizer)
    check_task(spec, inputs.schema, tokenizer, vocab_size)
    fingerprint = {
        "model": checkpoint_fingerprint(checkpoint),
        "prompt": {"template": spec.prompt.template, "column": spec.prompt.column,
                   "token_ids_column": spec.prompt.token_ids_column, "chat": spec.chat, "system": spec.system,
                   "chat_template_kwargs": dict(spec.prompt.chat_template_kwargs)},
        "reasoning": reasoning,
        "id_column": spec.id_column,
        "sampling": spec.sampling,
        **({"task": spec.task} if spec.task != TaskSpec() else {}),  # absent for plain jobs: their folders resume
        "input": input_fingerprint(inputs),
        "rows": inputs.num_rows if spec.limit is None else min(spec.limit, inputs.num_rows),
    }
    if spec.output.remote:  # an s3:// folder: its manifest and parts synced down for the resume check
        pull_output(spec)
    _check_output(spec)
    check_resumable(spec.output.path, fingerprint, overwrite, spec.job_file, spec.where("output"))
    return PreparedJob(spec, checkpoint, vocab_size, tokenizer, inputs, fingerprint, sampling, reasoning,
                       max_prompt_chars)
