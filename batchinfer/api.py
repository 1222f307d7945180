"""The Python API: `run` a job file (or a job as a dict), or keep one engine in an `LLM` and
`generate` from prompts, chat conversations or a table.

Both go through the job machinery the CLI uses (prepare, global plan, prefix reuse, chat
templates, reasoning split, sampling defaults, structured output, logprobs, scoring), so a
Python call writes the same rows as `batchinfer run` on the same job. Errors in what is passed
raise `JobError` (a ValueError: one line naming the key); a run that fails raises
`JobRuntimeError`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import EngineLike, open_engine, run_job
from batchinfer.jobs.spec.job_file import JobFile, load_job_file, parse_job_document

JobSource = Union[str, os.PathLike, Mapping[str, Any]]
_DICT_JOB_FILE = "<job dict>"  # names a dict job in error messages; its relative paths resolve against base_dir


def _job_file(job: JobSource, base_dir: Optional[Path]) -> JobFile:
    if isinstance(job, Mapping):
        return parse_job_document(dict(job), Path(base_dir or Path.cwd()).resolve() / _DICT_JOB_FILE)
    return load_job_file(Path(job))


def run(job: JobSource, *, name: Optional[str] = None, overwrite: bool = False, workers: Optional[int] = None,
        base_dir: Optional[Path] = None, progress: bool = True) -> dict[str, Any]:
    """Run a job file's jobs (or the one called `name`), resuming where an earlier run stopped, as
    `batchinfer run` does. `job`: a path, or the file's content as a dict ({"jobs": [...]} with
    optional "defaults"), whose relative paths resolve against `base_dir` (default: the current
    folder). Returns the job's stats (its `_stats.json` content); with several jobs, a dict of
    job name -> stats."""
    specs = _job_file(job, base_dir).select(name)
    if workers is not None:
        specs = tuple(replace(spec, parallel=replace(spec.parallel, workers=workers)) for spec in specs)
    prepared = [prepare_job(spec, overwrite) for spec in specs]  # every job checked before the first runs
    console = Console(quiet=not progress)
    results = {p.spec.name: run_job(p, console, overwrite=overwrite) for p in prepared}
    return next(iter(results.values())) if len(results) == 1 else results


class LLM:
    """One model kept loaded between calls: `LLM("demo").generate(["The capital of", ...])`.

    `engine` takes the job file's `engine:` keys (device, dtype, max_running, ...). Each
    `generate` call is one job over its rows, planned as a whole (shared prefixes computed once),
    run on this object's engine. Ctrl-C (KeyboardInterrupt) during a call closes the engine
    cleanly; the next call loads it again."""

    def __init__(self, model: str, *, progress: bool = False, base_dir: Optional[Path] = None, **engine: Any) -> None:
        self.model = model
        self.engine_settings = dict(engine)
        self.progress = progress
        self.base_dir = Path(base_dir or Path.cwd()).resolve()
        self._engine: Optional[EngineLike] = None
        self.last_stats: Optional[dict[str, Any]] = None  # the stats of the last generate call

    def generate(self, prompts: Any, *, template: Optional[str] = None, column: Optional[str] = None,
                 chat: bool = False, system: Optional[str] = None, sampling: Optional[Mapping[str, Any]] = None,
                 **job: Any) -> Any:
        """Generate for each row. `prompts`:
        - a list of strings: the prompts (with `chat=True`, each is the user message);
        - a list of conversations (each a list of {"role", "content"} messages), rendered through
          the checkpoint's chat template;
        - a pyarrow Table or polars DataFrame, with `template` ("{document}\\nQ: {question}") or
          `column` naming its prompt column.
        `sampling` takes the job file's `sampling:` keys; `**job` any other job key (task,
        reasoning, id_column, chat_template_kwargs, ...). Returns, for a table, a table of the same
        kind with the columns a job writes (the input's beside each sample's); for a list, a list
        of row dicts in input order."""
        table, prompt, kind, chat = self._input_table(prompts, template, column, chat, job)
        work = Path(tempfile.mkdtemp(prefix="batchinfer-llm-"))
        try:
            pq.write_table(table, work / "input.parquet")
            spec = {"name": "generate", "model": self.model, "input": str(work / "input.parquet"), "prompt": prompt,
                    "chat": chat, "system": system, "sampling": dict(sampling or {}),
                    "engine": dict(self.engine_settings),
                    "output": {"path": str(work / "out"), "order": "input"}, "parallel": {"workers": 1}, **job}
            prepared = prepare_job(parse_job_document({"jobs": [spec]}, self.base_dir / _DICT_JOB_FILE).jobs[0])
            self.last_stats = self._run(prepared)
            result = pq.read_table(work / "out")  # the parts, in input order; `_stats.json` etc. are skipped
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return _as_kind(result, kind)

    def _run(self, prepared: PreparedJob) -> dict[str, Any]:
        def engine_for(job: PreparedJob, window_rows: int) -> EngineLike:
            if self._engine is None:
                self._engine = open_engine(job, window_rows)
            self._engine.restart_stats()  # an LLM keeps one engine across calls: each call's stats are its own
            return self._engine

        try:
            return run_job(prepared, Console(quiet=not self.progress), engine_factory=engine_for)
        except BaseException:
            self.close()  # an engine stopped mid-step holds half-run sequences: start the next call afresh
            raise

    def close(self) -> None:
        """Free the engine (and its GPU memory); the next `generate` loads it again."""
        if self._engine is None:
            return
        self._engine = None
        import gc
        gc.collect()
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _input_table(self, prompts: Any, template: Optional[str], column: Optional[str], chat: bool,
                     job: dict) -> tuple[pa.Table, dict, str, bool]:
        """(input table, the job's `prompt:` block, "arrow" / "polars" / "list", chat)."""
        if _is_polars(prompts) or isinstance(prompts, pa.Table):
            kind = "polars" if _is_polars(prompts) else "arrow"
            table = prompts.to_arrow() if kind == "polars" else prompts
            if (template is None) == (column is None):
                raise JobError(Path(_DICT_JOB_FILE), "prompt", "a table needs exactly one of template= or column=")
            return table, ({"template": template} if template is not None else {"column": column}), kind, chat
        if template is not None or column is not None:
            raise JobError(Path(_DICT_JOB_FILE), "prompt", "template= and column= are for tables; pass a list of prompts")
        prompts = list(prompts)
        if prompts and all(_is_conversation(p) for p in prompts):
            if chat or job.get("system") is not None:
                raise JobError(Path(_DICT_JOB_FILE), "chat", "conversations are rendered as given: leave chat and system out")
            tokenizer = self._tokenizer()
            kwargs = dict(job.get("chat_template_kwargs") or {})
            texts = [tokenizer.render_messages(list(p), kwargs) for p in prompts]
            return pa.table({"prompt": pa.array(texts, pa.string())}), {"column": "prompt"}, "list", False
        if not all(isinstance(p, str) for p in prompts):
            raise JobError(Path(_DICT_JOB_FILE), "prompts",
                           "must be a list of strings, a list of conversations, a pyarrow Table or a polars DataFrame")
        return pa.table({"prompt": pa.array(prompts, pa.string())}), {"column": "prompt"}, "list", chat

    def _tokenizer(self):
        from batchinfer.jobs.spec.checkpoint import resolve_checkpoint
        from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

        probe = parse_job_document({"jobs": [{"name": "generate", "model": self.model, "input": "unused.parquet",
                                              "prompt": {"column": "prompt"}}]}, self.base_dir / _DICT_JOB_FILE)
        return CheckpointTokenizer.from_checkpoint(resolve_checkpoint(probe.jobs[0]))


def _is_polars(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "polars" and type(value).__name__ == "DataFrame"


def _is_conversation(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value))


def _as_kind(table: pa.Table, kind: str) -> Any:
    if kind == "polars":
        import polars as pl
        return pl.from_arrow(table)
    if kind == "arrow":
        return table
    return table.to_pylist()
