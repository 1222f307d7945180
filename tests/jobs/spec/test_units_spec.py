"""Job keys of the unit-by-unit run: parallel:, output.order / keep_work, engine.plan."""
from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.spec.parallel import ParallelSpec
from batchinfer.jobs.spec.job_file import engine_config_kwargs, engine_settings_dict, parse_job_file

JOB_FILE = Path("/project/jobs/jobs.yaml")
BASE = """
jobs:
  - name: rag
    model: demo
    input: data.parquet
    prompt: {column: text}
"""


def parse(extra: str = ""):
    return parse_job_file(BASE + extra, JOB_FILE).jobs[0]


def test_defaults_completion_order_work_deleted_global_plan_auto_workers():
    job = parse()
    assert (job.output.order, job.output.keep_work) == ("completion", False)
    assert job.parallel == ParallelSpec("auto", "local", "auto")


def test_keys_are_read():
    job = parse("    output: {path: o, order: input, keep_work: true}\n"
                "    parallel: {workers: 2, executor: ray, ray_address: 'ray://h:10001'}\n")
    assert (job.output.order, job.output.keep_work, job.output.path) == ("input", True, Path("/project/jobs/o"))
    assert job.parallel == ParallelSpec(2, "ray", "ray://h:10001")


def test_the_stats_report_the_plan_and_state_cache_arms_beside_the_job_keys():
    settings = parse("    engine: {max_running: 3}\n").engine
    assert engine_settings_dict(settings)["plan"] == "global" and engine_settings_dict(settings, "window")["plan"] == "window"
    assert "plan" not in engine_config_kwargs(settings)
    assert engine_config_kwargs(settings)["state_cache"] == "extra_buffer"


@pytest.mark.parametrize("extra, where, what", [
    ("    output: {path: o, order: sorted}\n", "jobs.rag.output.order", "completion, input"),
    ("    output: {path: o, keep_work: 1}\n", "jobs.rag.output.keep_work", "true or false"),
    ("    engine: {plan: window}\n", "jobs.rag.engine.plan", "comparison arm, not a job key"),
    ("    engine: {state_cache: no_buffer}\n", "jobs.rag.engine.state_cache", "comparison arm, not a job key"),
    ("    parallel: {workers: 0}\n", "jobs.rag.parallel.workers", "auto or an integer >= 1"),
    ("    parallel: {workers: true}\n", "jobs.rag.parallel.workers", "auto or an integer >= 1"),
    ("    parallel: {executor: slurm}\n", "jobs.rag.parallel.executor", "local, ray"),
    ("    parallel: {worker: 2}\n", "jobs.rag.parallel.worker", "did you mean 'workers'"),
    ("    parallel: 2\n", "jobs.rag.parallel", "must be a mapping"),
])
def test_bad_values_are_one_located_error(extra, where, what):
    with pytest.raises(JobError) as caught:
        parse(extra)
    message = str(caught.value)
    assert where in message and what in message, message
