"""Job file validation: defaults, path resolution, and one located error per mistake."""
from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.spec.job_file import DEMO_MODEL, EngineSettings, load_job_file, parse_job_file

JOB_FILE = Path("/project/jobs/jobs.yaml")


def parse(text: str):
    return parse_job_file(text, JOB_FILE)


def error_of(text: str) -> str:
    with pytest.raises(JobError) as caught:
        parse(text)
    return str(caught.value)


MINIMAL = """
jobs:
  - name: rag
    model: ../models/m
    input: data/*.parquet
    prompt: {template: "{document} Q: {question}"}
"""


def test_minimal_job_gets_defaults_and_paths_relative_to_the_job_file():
    job = parse(MINIMAL).jobs[0]
    assert job.model == "/project/models/m"
    assert job.input == "/project/jobs/data/*.parquet"
    assert job.output.path == Path("/project/jobs/out/rag") and job.output.flush_rows == 1000
    assert job.engine == EngineSettings()
    assert job.sampling.max_tokens == 128 and job.sampling.n == 1 and job.sampling.stop == ()
    assert (job.chat, job.system, job.id_column, job.limit) == (False, None, None, None)


def test_defaults_deep_merge_into_every_job_and_jobs_override_them():
    text = """
defaults:
  model: demo
  sampling: {max_tokens: 16, temperature: 0.5}
  engine: {max_running: 8}
jobs:
  - name: a
    input: /abs/a.parquet
    prompt: {column: text}
    sampling: {temperature: 0.0, stop: "END"}
  - name: b-2
    input: b.parquet
    prompt: {token_ids_column: ids}
    output: {path: /elsewhere, flush_rows: 7}
    engine: {replayssm: false, max_model_len: 512}
"""
    a, b = parse(text).jobs
    assert a.model == b.model == DEMO_MODEL
    assert a.input == "/abs/a.parquet"
    assert (a.sampling.max_tokens, a.sampling.temperature, a.sampling.stop) == (16, 0.0, ("END",))
    assert (b.sampling.max_tokens, b.sampling.temperature) == (16, 0.5)
    assert a.engine.max_running == 8 and a.engine.replayssm is True
    assert (b.engine.max_running, b.engine.replayssm, b.engine.max_model_len) == (8, False, 512)
    assert b.output.path == Path("/elsewhere") and b.output.flush_rows == 7


def test_null_step_and_row_settings_leave_them_to_the_model_and_the_kv_pool_may_be_fp8():
    text = """
defaults:
  model: demo
  engine: {max_running: 8, max_batch_tokens: 2048}
jobs:
  - name: a
    input: /abs/a.parquet
    prompt: {column: text}
    engine: {max_running: null, max_batch_tokens: null, kv_cache_dtype: fp8_e4m3}
"""
    (a,) = parse(text).jobs
    assert (a.engine.max_running, a.engine.max_batch_tokens) == (None, None)
    assert a.engine.kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("snippet, where, what", [
    ("    sampling: {temprature: 0.5}", "jobs.rag.sampling.temprature", "did you mean 'temperature'"),
    ("    engine: {max_runing: 4}", "jobs.rag.engine.max_runing", "did you mean 'max_running'"),
    ("    outptu: out", "jobs[0].outptu", "did you mean 'output'"),
    ("    sampling: {max_tokens: 0}", "jobs.rag.sampling.max_tokens", "must be >= 1"),
    ("    sampling: {top_p: 0}", "jobs.rag.sampling.top_p", "must be in (0.0, 1.0]"),
    ("    sampling: {n: 2.5}", "jobs.rag.sampling.n", "must be an integer"),
    ("    sampling: {ignore_eos: 'yes'}", "jobs.rag.sampling.ignore_eos", "must be true or false"),
    ("    sampling: {stop: [1, 2]}", "jobs.rag.sampling.stop", "list of non-empty strings"),
    ("    engine: {state_cache: big_buffer}", "jobs.rag.engine.state_cache", "comparison arm"),
    ("    engine: {device: tpu}", "jobs.rag.engine.device", "cuda:N"),
    ("    engine: {kv_cache_dtype: fp4}", "jobs.rag.engine.kv_cache_dtype", "fp8_e4m3"),
    ("    engine: {memory_fraction: 1.5}", "jobs.rag.engine.memory_fraction", "must be in"),
    ("    limit: 0", "jobs.rag.limit", "must be >= 1"),
    *[(f"    {section}: {{{key}: {value}}}", f"jobs.rag.{section}.{key}", f"must be a finite number, got {shown}")
      for section, key in [("sampling", "temperature"), ("sampling", "top_p"), ("sampling", "min_p"),
                           ("sampling", "repetition_penalty"), ("engine", "memory_fraction")]
      for value, shown in [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf")]],
    ("    sampling: {temperature: -1}", "jobs.rag.sampling.temperature", "must be >= 0.0, got -1"),
    ("    sampling: {repetition_penalty: 0}", "jobs.rag.sampling.repetition_penalty", "must be > 0.0, got 0"),
    ("    sampling: {seed: 18446744073709551616}", "jobs.rag.sampling.seed", "must be an integer in [0, 2**64)"),
    ("    sampling: {seed: -1}", "jobs.rag.sampling.seed", "must be an integer in [0, 2**64), got -1"),
    ("    sampling: {max_tokens: 9223372036854775808}", "jobs.rag.sampling.max_tokens",
     "must be <= 9223372036854775807"),
    ("    sampling: {max_tokens: 4, min_tokens: 5}", "jobs.rag.sampling.min_tokens",
     "must be <= max_tokens (4), got 5"),
    ("    sampling: {min_tokens: 129}", "jobs.rag.sampling.min_tokens", "must be <= max_tokens (128), got 129"),
    ("    engine: {max_model_len: 1}", "jobs.rag.engine.max_model_len", "must be >= 2, got 1"),
    ("    chat: 1", "jobs.rag.chat", "true or false"),
    ("    output: {flush_rows: 5}", "jobs.rag.output.path", "missing"),
    ("    output: {path: o, flush_row: 5}", "jobs.rag.output.flush_row", "did you mean 'flush_rows'"),
])
def test_each_bad_key_is_one_located_error(snippet, where, what):
    message = error_of(MINIMAL + snippet + "\n")
    assert message.startswith(f"{JOB_FILE}: {where}: "), message
    assert what in message and "\n" not in message


@pytest.mark.parametrize("text, where, what", [
    ("jobs: [", "line 1", "malformed YAML"),
    ("", "jobs", "empty job file"),
    ("jobs: []", "jobs", "non-empty list"),
    ("job: []", "(top level).job", "did you mean 'jobs'"),
    ("jobs:\n  - 3", "jobs[0]", "must be a mapping"),
    ("jobs:\n  - {name: 'bad name', model: m, input: i, prompt: {column: c}}", "jobs[0].name", "[A-Za-z0-9_-]+"),
    ("jobs:\n  - {name: a, input: i, prompt: {column: c}}", "jobs.a.model", "missing"),
    ("jobs:\n  - {name: a, model: m, input: i, prompt: {}}", "jobs.a.prompt", "exactly one"),
    ("jobs:\n  - {name: a, model: m, input: i, prompt: {column: c, template: t}}", "jobs.a.prompt", "exactly one"),
    ("jobs:\n  - {name: a, model: m, input: i, prompt: {colum: c}}", "jobs.a.prompt.colum", "did you mean 'column'"),
    ("jobs:\n  - {name: a, model: m, input: i, prompt: {token_ids_column: c}, chat: true}", "jobs.a.chat",
     "already tokenised"),
    ("jobs:\n  - {name: a, model: m, input: i, prompt: {column: c}}\n"
     "  - {name: a, model: m, input: j, prompt: {column: c}, output: o2}", "jobs.a.name", "duplicate"),
    ("jobs:\n  - {name: a, model: m, input: i, prompt: {column: c}, output: o}\n"
     "  - {name: b, model: m, input: j, prompt: {column: c}, output: o}", "jobs.b.output", "same output folder"),
    ("defaults: {nmae: x}\njobs: []", "defaults.nmae", "unknown key"),
])
def test_file_level_mistakes(text, where, what):
    message = error_of(text)
    assert message.startswith(f"{JOB_FILE}: {where}: "), message
    assert what in message and "\n" not in message


def test_the_widest_seed_and_min_tokens_equal_to_max_tokens_are_accepted():
    job = parse(MINIMAL + "    sampling: {seed: 18446744073709551615, max_tokens: 5, min_tokens: 5}\n").jobs[0]
    assert (job.sampling.seed, job.sampling.min_tokens) == (2**64 - 1, 5)
    assert parse(MINIMAL + "    engine: {max_model_len: 2}\n").jobs[0].engine.max_model_len == 2


def test_missing_job_file_and_unknown_job_name(tmp_path):
    with pytest.raises(JobError, match="no such job file"):
        load_job_file(tmp_path / "nope.yaml")
    path = tmp_path / "jobs.yaml"
    path.write_text(MINIMAL)
    with pytest.raises(JobError, match=r"--job rga: no such job \(did you mean 'rag'\?\)"):
        load_job_file(path).select("rga")
    assert [job.name for job in load_job_file(path).select("rag")] == ["rag"]


def test_engine_section_is_engine_config_with_its_defaults():
    """The job's engine keys are EngineConfig's own fields (plus the job-only `plan`), and a job
    that sets none runs with EngineConfig's defaults: the defaults live in one place."""
    from dataclasses import fields

    from batchinfer.engine.config import EngineConfig
    from batchinfer.jobs.spec.job_file import ENGINE_KEYS, engine_config_kwargs

    config_fields = {f.name for f in fields(EngineConfig)}
    assert set(ENGINE_KEYS) <= config_fields
    defaults = EngineConfig()
    assert all(getattr(defaults, key) == value for key, value in engine_config_kwargs(EngineSettings()).items())
    assert EngineConfig(**engine_config_kwargs(EngineSettings(max_running=3))).max_running == 3
