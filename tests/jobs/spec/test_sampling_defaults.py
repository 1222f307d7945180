"""Sampling precedence: the job's values, else generation_config.json, else the built-in defaults."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from batchinfer.engine.types import SamplingParams
from batchinfer.jobs.errors import JobError
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

QWEN_GENERATION_CONFIG = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 20,
                          "presence_penalty": 1.5, "eos_token_id": [2], "transformers_version": "4.57.0"}


def _checkpoint(folder: Path, generation_config: dict) -> Path:
    checkpoint = make_tokenizer_checkpoint(folder)
    (checkpoint / "generation_config.json").write_text(json.dumps(generation_config))
    return checkpoint


def _prepare(tmp_path: Path, generation_config: dict, sampling: dict, defaults: dict = None):
    checkpoint = _checkpoint(tmp_path / "ckpt", generation_config)
    write_parquet(rag_table(4), tmp_path / "data" / "rag.parquet")
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), sampling=sampling)], defaults=defaults)
    return prepare_job(load_job_file(job_file).jobs[0])


def test_job_values_win_then_generation_config_then_defaults(tmp_path):
    job = _prepare(tmp_path, QWEN_GENERATION_CONFIG, {"max_tokens": 6, "temperature": 0.5})
    params = job.spec.sampling
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens) == (0.5, 0.95, 20, 0.0, 6)
    sources = dict(job.sampling.sources)
    assert sources["temperature"] == "job" and sources["max_tokens"] == "job"
    assert sources["top_p"] == sources["top_k"] == "generation_config.json"
    assert sources["min_p"] == sources["repetition_penalty"] == sources["seed"] == "default"
    assert job.sampling.ignored == ("presence_penalty",)
    assert job.fingerprint["sampling"] == params  # a changed generation_config cannot resume old parts


def test_values_from_the_defaults_block_count_as_the_jobs_own(tmp_path):
    job = _prepare(tmp_path, QWEN_GENERATION_CONFIG, {}, defaults={"sampling": {"top_k": 5}})
    assert job.spec.sampling.top_k == 5 and dict(job.sampling.sources)["top_k"] == "job"
    assert job.spec.sampling.temperature == 1.0


def test_use_generation_config_false_leaves_the_checkpoint_values_out(tmp_path):
    job = _prepare(tmp_path, QWEN_GENERATION_CONFIG, {"max_tokens": 6, "use_generation_config": False})
    assert job.spec.sampling == SamplingParams(max_tokens=6)
    assert set(dict(job.sampling.sources).values()) == {"job", "default"} and job.sampling.ignored == ()


def test_do_sample_false_means_greedy_as_in_transformers(tmp_path):
    job = _prepare(tmp_path, {**QWEN_GENERATION_CONFIG, "do_sample": False}, {"max_tokens": 6})
    assert job.spec.sampling.temperature == 0.0 and job.spec.sampling.top_k == 20


def test_a_checkpoint_without_sampling_values_keeps_the_builtin_defaults(tmp_path):
    job = _prepare(tmp_path, {"eos_token_id": 2}, {"max_tokens": 6})
    assert job.spec.sampling == SamplingParams(max_tokens=6)


@pytest.mark.parametrize("bad, what", [({"top_p": 0}, "top_p: must be in (0.0, 1.0]"),
                                       ({"top_k": "many"}, "top_k: must be an integer")])
def test_a_bad_generation_config_value_is_a_one_line_error(tmp_path, bad, what):
    with pytest.raises(JobError) as caught:
        _prepare(tmp_path, {**QWEN_GENERATION_CONFIG, **bad}, {"max_tokens": 6})
    assert caught.value.where == "jobs.rag.model" and caught.value.what.startswith(f"generation_config.json: {what}")


def test_the_engine_gets_the_resolved_values_and_stats_and_summary_say_where_each_came_from(tmp_path):
    job = _prepare(tmp_path, QWEN_GENERATION_CONFIG, {"max_tokens": 6, "temperature": 0.7})
    engine = FakeEngine()
    output = io.StringIO()
    stats = run_job(job, Console(file=output, width=200), engine_factory=lambda _job, _rows: engine)
    assert {request.sampling for call in engine.calls for request in call} == {job.spec.sampling}
    written = json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())
    assert written["sampling"] == stats["sampling"]
    assert written["sampling"]["values"]["top_k"] == 20 and written["sampling"]["values"]["temperature"] == 0.7
    assert written["sampling"]["sources"]["top_k"] == "generation_config.json"
    assert written["sampling"]["generation_config_ignored"] == ["presence_penalty"]
    summary = output.getvalue()
    assert "sampling (generation_config.json)" in summary and "top_p=0.95, top_k=20" in summary
    assert "temperature=0.7" in summary and "presence_penalty" in summary
