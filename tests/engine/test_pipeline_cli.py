"""Pipeline stages through `batchinfer run` / `plan` on the demo model (CPU): the same tokens and
reuse = the global ideal with 1 and 2 stages, the stage split in the plan, a bad stage count
refused, and a 2-stage run killed mid-job then rerun holding every (row, sample) exactly once."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.job_process import demo_cache, keys, read_parts, run_in_this_process, start_run, wait_for, write_demo_job  # noqa: F401
from tests.cli_utils import invoke_cli as invoke


def _stats(out_dir: Path) -> dict:
    return json.loads((out_dir / "_stats.json").read_text())


@pytest.mark.slow
def test_two_and_four_stages_give_the_one_stage_tokens_with_ideal_reuse(tmp_path, demo_cache):
    outputs = {}
    for stages in (1, 2, 4):
        folder = tmp_path / f"s{stages}"
        out_dir = write_demo_job(folder, 6, sampling={"max_tokens": 6, "n": 2, "ignore_eos": True})
        result = run_in_this_process(folder, "--pipeline-stages", str(stages))
        assert result.exit_code == 0, (result.output, result.exception)
        table = read_parts(out_dir)
        outputs[stages] = list(zip(keys(table), table["output_token_ids"].to_pylist()))
        stats = _stats(out_dir)
        assert stats["cached_tokens"] == stats["plan"]["global_ideal_cached_tokens"] > 0
        if stages > 1:
            assert len(stats["engine_settings"]["pipeline"]["stage_busy_seconds"]) == stages
    assert outputs[2] == outputs[1] and outputs[4] == outputs[1]


def test_plan_shows_the_stage_split_and_a_bad_count_is_exit_2(tmp_path, demo_cache):
    write_demo_job(tmp_path, 4, parallel={"pipeline_stages": 2})
    plan = invoke(tmp_path, "plan", "jobs.yaml")
    assert plan.exit_code == 0, plan.output
    assert "pipeline stages: stage 0: layers 0-" in plan.output and "predicted balance" in plan.output
    bad = invoke(tmp_path, "run", "jobs.yaml", "--pipeline-stages", "9")
    assert bad.exit_code == 2
    assert "parallel.pipeline_stages: must be at most the model's 8 layers, got 9" in bad.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_two_stage_run_killed_mid_job_then_rerun_holds_each_sample_once(tmp_path, demo_cache):
    rows = 13
    out_dir = write_demo_job(tmp_path, rows, parallel={"pipeline_stages": 2})
    process = start_run(tmp_path, demo_cache)
    wait_for(lambda: bool(list(out_dir.glob("part-*.parquet"))), process)
    process.send_signal(signal.SIGKILL)
    _, stderr = process.communicate()
    assert process.returncode == -signal.SIGKILL, stderr
    done_before = read_parts(out_dir).num_rows
    assert 0 < done_before < rows

    result = run_in_this_process(tmp_path)
    assert result.exit_code == 0, (result.output, result.exception)
    out = read_parts(out_dir)
    assert keys(out) == [(r, 0) for r in range(rows)]
    stats = _stats(out_dir)
    assert stats["samples_resumed"] == done_before and stats["samples_written"] == rows - done_before
