"""Job files: YAML in, validated frozen `JobSpec`s out.

The file is read as YAML 1.2 (`jobs/spec/yaml_loader.py`). Every mistake a user can make in a job
file becomes one `JobError` naming the file, the key path (e.g. `jobs.rag.sampling.temprature`)
and what is wrong, with a "did you mean" for misspelt keys. Relative paths resolve against the
job file's own folder, so a job file travels with its data. Only the file itself is read here:
whether inputs, columns and checkpoints exist is checked by `prepare.prepare_job`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.types import SamplingParams
from batchinfer.jobs.spec import checks as check
from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.spec.parallel import PARALLEL_KEYS, ParallelSpec
from batchinfer.jobs.spec.checks import Checker, did_you_mean
from batchinfer.jobs.spec.urls import INPUT_SCHEMES, is_url, output_url_problem, staging_folder, url_scheme
from batchinfer.jobs.spec.task import TASK_JOB_KEYS, TaskSpec, parse_task, split_task_sampling
from batchinfer.jobs.spec.yaml_loader import DuplicateKeyError, JobFileSizeError, load_yaml

JOB_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]+")  # fullmatch: `$` would let a final newline through
DEMO_MODEL = "demo"


@dataclass(frozen=True)
class PromptSpec:
    """Exactly one of the three ways to get a prompt from a row."""

    template: Optional[str] = None          # "{document}\n\nQuestion: {question}"
    column: Optional[str] = None            # a column holding the whole prompt text
    token_ids_column: Optional[str] = None  # a column of pre-tokenised prompts (list of ints)
    # the job's `chat_template_kwargs`: extra chat-template variables, as transformers'
    # apply_chat_template(**kwargs) passes them; ((name, value), ...) sorted by name
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    error_column: Optional[str] = None      # set for OpenAI batch input: a non-null value is the row's error


@dataclass(frozen=True)
class EngineSettings(EngineConfig):
    """The job's `engine:` block: `EngineConfig` itself (its fields, its defaults). A job file sets
    only the keys of `ENGINE_KEYS`; a benchmark may set any field from Python (`dataclasses.replace`)."""


@dataclass(frozen=True)
class OutputSpec:
    path: Path
    flush_rows: int = 1000
    # completion: rows as units finish (readers may consume parts as they appear);
    # input: one ordered compaction at the end rewrites the parts in row_index order
    order: str = "completion"
    keep_work: bool = False    # keep the planning folder `_work/` after the job completes
    # parquet: the parts only; openai: also the batch output lines (jobs/formats/openai_batch.py), from the parts
    format: str = "parquet"
    # with format openai, where failed lines go: openai (an error file, the error in the response body) | vllm
    error_form: str = "openai"
    remote: Optional[str] = None  # an s3:// folder: `path` is then its local staging mirror (jobs/spec/urls.py)


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: str                 # DEMO_MODEL or an absolute checkpoint path
    input: str                 # absolute file, folder or glob
    prompt: PromptSpec
    sampling: SamplingParams
    engine: EngineSettings
    output: OutputSpec
    chat: bool = False
    system: Optional[str] = None
    reasoning: str = "auto"    # auto | split | raw (jobs/tasks/reasoning.py)
    # sampling keys the job set itself; the rest come from generation_config.json or the defaults
    sampling_keys: frozenset[str] = frozenset()
    use_generation_config: bool = True
    id_column: Optional[str] = None
    limit: Optional[int] = None
    parallel: ParallelSpec = ParallelSpec()
    task: TaskSpec = TaskSpec()  # logprobs, scoring, structured output, eval (jobs/spec/task.py)
    # auto (by name: jobs/inputs/readers.py) | parquet | csv | jsonl | arrow | hf_dataset | openai_batch
    input_format: str = "auto"
    job_file: Path = Path("jobs.yaml")  # for error messages

    def where(self, key: str) -> str:
        """Key path of this job's `key` in error messages."""
        return f"jobs.{self.name}.{key}" if key else f"jobs.{self.name}"


@dataclass(frozen=True)
class JobFile:
    path: Path
    jobs: tuple[JobSpec, ...]

    def select(self, name: Optional[str]) -> tuple[JobSpec, ...]:
        if name is None:
            return self.jobs
        names = [job.name for job in self.jobs]
        if name not in names:
            raise JobError(self.path, f"--job {name}", f"no such job{did_you_mean(name, names)}")
        return tuple(job for job in self.jobs if job.name == name)


# --- what each section may hold: key → value checker (jobs/spec/checks.py) ---
SAMPLING_KEYS: dict[str, Callable[[Any], Any]] = {
    "max_tokens": check.integer(1), "temperature": check.number(0.0),
    "top_p": check.number(0.0, 1.0, low_open=True), "top_k": check.integer(0), "min_p": check.number(0.0, 1.0),
    "repetition_penalty": check.number(0.0, low_open=True), "seed": check.seed,
    "stop": check.stop_strings, "n": check.integer(1), "ignore_eos": check.boolean, "min_tokens": check.integer(0),
    "use_generation_config": check.boolean,
}
REASONING_MODES = ("auto", "split", "raw")
# `input_format:`; auto: by the input's name (jobs/inputs/readers.py), a .jsonl being openai_batch
INPUT_FORMATS = ("auto", "parquet", "csv", "jsonl", "arrow", "hf_dataset", "openai_batch")
ENGINE_KEYS: dict[str, Callable[[Any], Any]] = {
    "device": check.device_name,
    "dtype": check.choice("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
    "prefix_cache": check.boolean, "replayssm": check.boolean, "kv_cache_dtype": check.choice("auto", "fp8_e4m3"),
    "ring_len": check.integer(1), "track_interval": check.integer(1), "max_running": check.integer(1, optional=True),
    "max_batch_tokens": check.integer(1, optional=True), "max_model_len": check.integer(2, optional=True),
    "memory_fraction": check.number(0.0, 1.0, low_open=True),
}
# Comparison arms of the benchmarks, set from Python (`run_job(plan=...)`, `EngineConfig.state_cache`):
# a job file naming one is refused, so no job runs an arm by accident. Reported in `_stats.json`.
BENCHMARK_ARMS = ("state_cache", "plan")
PROMPT_KEYS = {"template": check.text(), "column": check.text(), "token_ids_column": check.text()}
OUTPUT_KEYS = {"path": check.text(), "flush_rows": check.integer(1),
               "order": check.choice("completion", "input"), "keep_work": check.boolean,
               "format": check.choice("parquet", "openai"), "error_form": check.choice("openai", "vllm")}
JOB_KEYS = ("name", "model", "input", "input_format", "prompt", "chat", "system", "chat_template_kwargs", "reasoning", "id_column",
            "sampling", "engine", "output", "limit", "parallel") + TASK_JOB_KEYS
TOP_KEYS = ("defaults", "jobs")


def _deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _resolve(path_text: str, base: Path) -> Path:
    path = Path(path_text).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def _input_location(checker: Checker, text: str, base: Path, where: str) -> str:
    """A local input resolved against the job file's folder; an object-store URL as written."""
    if not is_url(text):
        return str(_resolve(text, base))
    if url_scheme(text) not in INPUT_SCHEMES:
        raise checker.fail(f"{where}.input", f"{text}: not a supported URL (s3://, gs://, http(s)://)")
    return text


def _output_spec(checker: Checker, output: dict, base: Path, where: str) -> OutputSpec:
    """A local output folder resolved; an s3:// one staged in a local mirror (jobs/outdir/remote_folder.py)."""
    path = output.pop("path")
    if not is_url(path):
        return OutputSpec(path=_resolve(path, base), **output)
    problem = output_url_problem(path)
    if problem:
        raise checker.fail(f"{where}.output.path", problem)
    return OutputSpec(path=staging_folder(path), remote=path.rstrip("/"), **output)


def _sampling(checker: Checker, raw: Any, where: str) -> tuple[SamplingParams, frozenset[str], bool]:
    """(the job's own sampling values over the built-in defaults, the keys it set, use_generation_config)."""
    values = checker.section(raw, where, SAMPLING_KEYS)
    use_generation_config = values.pop("use_generation_config", True)
    defaults = SamplingParams()
    min_tokens, max_tokens = (values.get(key, getattr(defaults, key)) for key in ("min_tokens", "max_tokens"))
    if min_tokens > max_tokens:
        raise checker.fail(f"{where}.min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
    try:
        return SamplingParams(**values), frozenset(values), use_generation_config
    except ValueError as exc:  # the engine's own checks; the key checks above should leave none
        raise checker.fail(where, str(exc)) from None


def _parse_job(raw: dict, index: int, checker: Checker, base: Path) -> JobSpec:
    where = f"jobs[{index}]"
    checker.mapping(raw, where, JOB_KEYS)
    name = raw.get("name")
    if not isinstance(name, str) or not JOB_NAME_PATTERN.fullmatch(name):
        raise checker.fail(f"{where}.name", f"must match [A-Za-z0-9_-]+, got {name!r}")
    where = f"jobs.{name}"
    input_format = raw.get("input_format", "auto")
    if input_format not in INPUT_FORMATS:
        raise checker.fail(f"{where}.input_format", f"must be one of {', '.join(INPUT_FORMATS)}, "
                                                    f"got {input_format!r}{did_you_mean(str(input_format), INPUT_FORMATS)}")
    if input_format == "auto" and isinstance(raw.get("input"), str) and raw["input"].endswith(BATCH_INPUT_SUFFIX):
        input_format = "openai_batch"  # a .jsonl is request lines unless the job says input_format: jsonl
    batch_input = input_format == "openai_batch"
    for key in ("model", "input") if batch_input else ("model", "input", "prompt"):
        if key not in raw:
            raise checker.fail(f"{where}.{key}", "missing (required)")

    def scalar(key: str, check: Callable[[Any], Any], default: Any) -> Any:
        try:
            return check(raw.get(key, default))
        except ValueError as exc:
            raise checker.fail(f"{where}.{key}", str(exc)) from None

    model = scalar("model", check.text(), None)
    input_pattern = scalar("input", check.text(), None)
    if batch_input:
        prompt = _batch_input_prompt(checker, raw, where)
    else:
        prompt = checker.section(raw["prompt"], f"{where}.prompt", PROMPT_KEYS)
    if len(prompt) != 1 and not batch_input:
        raise checker.fail(f"{where}.prompt", "needs exactly one of template, column, token_ids_column")
    chat = scalar("chat", check.boolean, False)
    if chat and "token_ids_column" in prompt:
        raise checker.fail(f"{where}.chat", "cannot be true with prompt.token_ids_column (already tokenised)")
    raw_sampling, task_sampling = split_task_sampling(raw.get("sampling", {}))
    sampling, sampling_keys, use_generation_config = _sampling(checker, raw_sampling, f"{where}.sampling")
    task = parse_task(checker, raw, task_sampling, where)
    if task.logprobs is not None:  # the engine computes them per request: SamplingParams carries k
        sampling = replace(sampling, logprobs=task.logprobs)
    template_kwargs = raw.get("chat_template_kwargs", {})
    if not isinstance(template_kwargs, dict) or not all(isinstance(key, str) for key in template_kwargs):
        raise checker.fail(f"{where}.chat_template_kwargs", "must be a mapping of template variable names to values")
    if template_kwargs and not chat and not batch_input:  # a batch file's chat lines use them too
        raise checker.fail(f"{where}.chat_template_kwargs", "needs chat: true (it is passed to the chat template)")
    reserved = sorted(set(template_kwargs) & {"messages", "add_generation_prompt"})
    if reserved:
        raise checker.fail(f"{where}.chat_template_kwargs.{reserved[0]}", "is set by batchinfer, not the job")
    reasoning = scalar("reasoning", check.choice(*REASONING_MODES), "auto")
    output = raw.get("output", f"out/{name}")
    output = checker.section({"path": output} if isinstance(output, str) else output, f"{where}.output",
                             OUTPUT_KEYS)
    if "path" not in output:
        raise checker.fail(f"{where}.output.path", "missing (required)")
    _check_batch_output(checker, output, batch_input, sampling, where)
    return JobSpec(
        name=name,
        model=model if model == DEMO_MODEL else str(_resolve(model, base)),
        input=_input_location(checker, input_pattern, base, where),
        input_format=input_format,
        prompt=PromptSpec(**prompt, chat_template_kwargs=tuple(sorted(template_kwargs.items()))),
        sampling=sampling,
        engine=EngineSettings(**checker.section(_without_arms(checker, raw.get("engine", {}), f"{where}.engine"),
                                                f"{where}.engine", ENGINE_KEYS)),
        output=_output_spec(checker, output, base, where),
        chat=chat,
        system=scalar("system", check.text(optional=True), None),
        reasoning=reasoning,
        sampling_keys=sampling_keys,
        use_generation_config=use_generation_config,
        id_column=BATCH_SEED_KEY_COLUMN if batch_input else scalar("id_column", check.text(optional=True), None),
        limit=scalar("limit", check.integer(1, optional=True), None),
        parallel=ParallelSpec(**checker.section(raw.get("parallel", {}), f"{where}.parallel", PARALLEL_KEYS)),
        task=task,
        job_file=checker.path,
    )


# OpenAI batch input (jobs/formats/openai_batch.py): the reader makes these columns from the request lines
BATCH_TOKEN_IDS_COLUMN = "prompt_token_ids"
BATCH_ERROR_COLUMN = "request_error"
BATCH_SEED_KEY_COLUMN = "seed_key"  # per (line, choice): the choices of a line draw different samples
BATCH_INPUT_SUFFIX = ".jsonl"


def openai_batch_input(spec: JobSpec) -> bool:
    """The job reads an OpenAI batch file of request lines (a `.jsonl` input, unless `input_format` says else)."""
    return spec.input_format == "openai_batch"


def _batch_input_prompt(checker: Checker, raw: dict, where: str) -> dict:
    """A batch file's lines carry their prompts: the job gives none, nor chat settings or an id column."""
    for key in ("prompt", "chat", "system", "id_column"):
        if key in raw:
            raise checker.fail(f"{where}.{key}", "not used with an OpenAI batch input (.jsonl): "
                                                 "each request line has its messages or prompt")
    return {"token_ids_column": BATCH_TOKEN_IDS_COLUMN, "error_column": BATCH_ERROR_COLUMN}


def _check_batch_output(checker: Checker, output: dict, batch_input: bool, sampling: SamplingParams,
                        where: str) -> None:
    """output.format openai needs request lines, and writes them in input order; n is per line."""
    if batch_input and sampling.n != 1:
        raise checker.fail(f"{where}.sampling.n", "set n in each request line's body (OpenAI batch input)")
    if output.get("format") != "openai":
        if "error_form" in output:
            raise checker.fail(f"{where}.output.error_form", "needs format: openai (it shapes the batch output lines)")
        return
    if not batch_input:
        raise checker.fail(f"{where}.output.format", "openai needs an OpenAI batch input (a .jsonl file)")
    if output.setdefault("order", "input") != "input":
        raise checker.fail(f"{where}.output.order", "must be input with format openai (lines follow the "
                                                    "request file)")


def parse_job_file(text: str, path: Path) -> JobFile:
    """Validate a job file's text; `path` locates relative paths and names errors."""
    checker = Checker(path)
    try:
        document = load_yaml(text)
    except (DuplicateKeyError, JobFileSizeError) as exc:
        mark = exc.problem_mark
        raise checker.fail(f"line {mark.line + 1}" if mark is not None else "yaml", exc.problem) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}" if mark is not None else "yaml"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise checker.fail(line, f"malformed YAML: {problem}") from None
    return parse_job_document(document, path)


def parse_job_document(document: Any, path: Path) -> JobFile:
    """Validate a job file's content (YAML already read, or a dict from Python: `batchinfer.run`);
    `path` locates relative paths and names errors."""
    checker = Checker(path)
    if document is None:
        raise checker.fail("jobs", "empty job file")
    checker.mapping(document, "(top level)", TOP_KEYS)
    defaults = document.get("defaults") or {}
    checker.mapping(defaults, "defaults", [k for k in JOB_KEYS if k != "name"])
    raw_jobs = document.get("jobs")
    if not isinstance(raw_jobs, list) or not raw_jobs:
        raise checker.fail("jobs", "must be a non-empty list of jobs")
    jobs = []
    for index, raw in enumerate(raw_jobs):
        if not isinstance(raw, dict):
            raise checker.fail(f"jobs[{index}]", f"must be a mapping, got {type(raw).__name__}")
        jobs.append(_parse_job(_deep_merge(defaults, raw), index, checker, path.parent.resolve()))
    seen_names: set[str] = set()
    for index, job in enumerate(jobs):
        if job.name in seen_names:
            raise checker.fail(job.where("name"), "duplicate job name")
        seen_names.add(job.name)
        for other in jobs[:index]:
            relation = output_relation(job.output.path, other.output.path)
            if relation == "same":
                raise checker.fail(job.where("output"), f"same output folder as job {other.name}")
            if relation is not None:
                raise checker.fail(job.where("output"), f"{display_path(job.output.path)} {relation} "
                                                        f"{display_path(other.output.path)}, the output folder of job "
                                                        f"{other.name}: {NESTED_OUTPUTS}")
    return JobFile(path=path, jobs=tuple(jobs))


NESTED_OUTPUTS = "one job's rerun or --overwrite would delete the other's files, and its readers read both"


def output_relation(path: Path, other: Path) -> Optional[str]:
    """How output folder `path` lies to folder `other`: "same", "is inside", "contains", or None when
    apart (links resolved: two names of one folder are one folder)."""
    real, other_real = Path(path).resolve(), Path(other).resolve()
    if real == other_real:
        return "same"
    if real.is_relative_to(other_real):
        return "is inside"
    if other_real.is_relative_to(real):
        return "contains"
    return None


def load_job_file(path: Path) -> JobFile:
    path = Path(path)
    if not path.is_file():
        raise JobError(path, "(file)", "no such job file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(path, "(file)", f"cannot read: {exc}") from None
    return parse_job_file(text, path)


def _without_arms(checker: Any, engine: Any, where: str) -> Any:
    arm = next((key for key in BENCHMARK_ARMS if isinstance(engine, dict) and key in engine), None)
    if arm is not None:
        raise checker.fail(f"{where}.{arm}", "is a benchmark's comparison arm, not a job key; remove it")
    return engine


def engine_config_kwargs(settings: EngineSettings) -> dict:
    """The settings `batchinfer.engine.EngineConfig` takes from a job: its keys and the state cache arm."""
    return {f.name: getattr(settings, f.name) for f in fields(settings) if f.name in ENGINE_KEYS or f.name == "state_cache"}


def engine_settings_dict(settings: EngineSettings, plan: str = "global") -> dict:
    """The engine settings `_stats.json` reports (a run on workers): `engine_config_kwargs` and the plan arm."""
    return {**engine_config_kwargs(settings), "plan": plan}
