"""`prepare_job`'s checks of the task settings (jobs/spec/task.py) against the input and tokenizer.

Columns exist and have usable types; a job-level grammar is compiled for the job's tokenizer
(a schema llguidance cannot compile is one line here, before anything runs); and what the
engine cannot do yet fails with one "not supported yet" line (`task_spec.ENGINE_FEATURES`).
"""
from __future__ import annotations

import pyarrow as pa

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.tasks.eval_metrics import CORRECT_COLUMN
from batchinfer.jobs.inputs.prompts import is_text
from batchinfer.jobs.spec.job_file import JobSpec, did_you_mean
from batchinfer.jobs.spec.task import ENGINE_FEATURES
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

ENGINE_FEATURE_OF = {"sampling.logprobs": "logprobs", "task": "score"}  # else a grammar key: "grammar"


def _is_list_of(dtype: pa.DataType, item: "callable") -> bool:
    return (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) and item(dtype.value_type)


def check_task(spec: JobSpec, schema: pa.Schema, tokenizer: CheckpointTokenizer, vocab_size: int) -> None:
    task = spec.task

    def fail(key: str, what: str) -> JobError:
        return JobError(spec.job_file, spec.where(key), what)

    def require(column: str, key: str) -> pa.DataType:
        if column not in schema.names:
            raise fail(key, f"column {column!r} is not in the input{did_you_mean(column, schema.names)}")
        return schema.field(column).type

    if task.task == "score" and spec.sampling.n != 1:
        raise fail("sampling.n", "must be 1 with task: score (each continuation is scored once)")
    if task.continuations_column is not None:
        dtype = require(task.continuations_column, "score.continuations_column")
        if not (is_text(dtype) or _is_list_of(dtype, is_text)):
            raise fail("score.continuations_column", f"column {task.continuations_column!r} must be text or a "
                                                     f"list of text, got {dtype}")
    if task.eval is not None:
        dtype = require(task.eval.answer_column, "eval.answer_column")
        usable = (is_text(dtype) or _is_list_of(dtype, is_text) if task.eval.metric == "exact_match"
                  else is_text(dtype) or pa.types.is_integer(dtype))
        if not usable:
            wanted = "text or a list of text" if task.eval.metric == "exact_match" else "an integer index or text"
            raise fail("eval.answer_column", f"column {task.eval.answer_column!r} must be {wanted}, got {dtype}")
        if CORRECT_COLUMN in schema.names:
            raise fail("eval", f"input column {CORRECT_COLUMN!r} has the name of the eval's output column")
    grammar = task.grammar
    if grammar is not None:
        from batchinfer.jobs.tasks.structured import GrammarError, mask_threads  # llguidance loads only for grammar jobs

        try:
            mask_threads()
        except GrammarError as exc:  # the environment, not the job file: said before anything runs
            raise fail(f"sampling.{grammar.kind}", str(exc)) from None
    if grammar is not None and grammar.kind == "json_schema_column":
        dtype = require(str(grammar.value), "sampling.json_schema_column")
        if not is_text(dtype):
            raise fail("sampling.json_schema_column", f"column {grammar.value!r} must be text (JSON), got {dtype}")
    elif grammar is not None:
        from batchinfer.jobs.tasks.structured import GrammarError, compile_grammar  # llguidance loads only for grammar jobs

        try:
            compile_grammar(grammar, tokenizer, vocab_size)
        except GrammarError as exc:
            raise fail(f"sampling.{grammar.kind}", f"cannot be compiled: {exc}") from None
    for key in task.needs_engine_features:
        if ENGINE_FEATURE_OF.get(key, "grammar") not in ENGINE_FEATURES:
            raise fail(key, "not supported yet by the engine")
