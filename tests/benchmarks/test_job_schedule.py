"""benchmarks/job_schedule.py: the engine's own schedule of a job, priced by measured step costs."""
from __future__ import annotations

import pytest

from benchmarks.job_schedule import CALIBRATIONS, Calibration, Forwards, Job, StepTimes, run_schedule


def test_the_trace_holds_every_prompt_token_once_and_every_later_token_in_a_decode_row():
    """16 prompts of 512 tokens, 8 rows at once, 2,048 prompt tokens a step: 4 prefill forwards, and
    every row decodes its output but the first token (drawn from its prefill) one step at a time."""
    trace = run_schedule(16, 512, 64, max_running=8, step_tokens=2048)
    assert sum(f.prefill_tokens for f in trace.steps) == 16 * 512
    assert sum(1 for f in trace.steps if f.prefill_tokens) == 4
    assert all(f.prefill_tokens <= 2048 for f in trace.steps)
    assert all(f.decode_rows <= 8 for f in trace.steps)
    assert sum(f.decode_rows for f in trace.steps) == 16 * 63
    # a row's t-th decode token attends over its prompt and the t tokens before it, itself included
    assert sum(f.decode_positions for f in trace.steps) == 16 * sum(512 + t for t in range(1, 64))
    summary = trace.summary()
    assert summary["decode_forwards"] == sum(1 for f in trace.steps if f.decode_rows)
    assert 7 < summary["mean_decode_rows"] <= 8


def test_more_rows_at_once_take_fewer_decode_forwards():
    narrow = run_schedule(16, 256, 32, max_running=4, step_tokens=1024)
    wide = run_schedule(16, 256, 32, max_running=16, step_tokens=1024)
    assert wide.summary()["decode_forwards"] < narrow.summary()["decode_forwards"] / 2


def test_a_decode_forward_reads_the_experts_its_rows_route_to():
    times = StepTimes(0, 0, decode_fixed_ms=1.0, decode_row_ms=0.0, decode_position_ms=0.0,
                      decode_experts_ms=10.0, experts=256, top_k=8)
    assert times.decode_ms(Forwards(decode_rows=1, decode_positions=1)) == pytest.approx(1.0 + 10.0 * 8 / 256)
    assert times.decode_ms(Forwards(decode_rows=512, decode_positions=1)) == pytest.approx(11.0, rel=1e-6)
    assert times.decode_ms(Forwards(prefill_tokens=100)) == 0.0


def test_the_fit_recovers_the_prefill_constants_that_made_the_jobs():
    """Two jobs timed by known constants, given back as 'measured': the fit returns those constants."""
    decode = StepTimes(0.0, 0.0, decode_fixed_ms=3.0, decode_row_ms=0.05, decode_position_ms=1e-4)
    truth = StepTimes(7.5, 0.02, 3.0, 0.05, 1e-4)
    jobs = [Job(24, 8, step, prompt_tokens=512, output_tokens=32) for step in (2048, 512)]
    measured = tuple(Job(j.prompts, j.max_running, j.step_tokens, j.trace().tok_s(truth), 512, 32) for j in jobs)
    fitted = Calibration(decode, fit=measured).times()
    assert fitted.prefill_step_ms == pytest.approx(7.5, rel=1e-9)
    assert fitted.prefill_token_ms == pytest.approx(0.02, rel=1e-9)


def test_the_fp8_moe_calibration_predicts_the_step_size_it_was_not_fitted_on():
    """The H200's 65,536-token job of the FP8 35B-A3B (41,613 total tok/s, 376 rows) from the
    constants fitted to its 32,768 and 8,192 jobs: within 3% (the engine's schedule is the model's)."""
    calibration = CALIBRATIONS["qwen3.5-35b-a3b-fp8"]
    times = calibration.times()
    for job in calibration.fit:
        assert job.trace().tok_s(times) == pytest.approx(job.tok_s, rel=1e-9)
    (check,) = calibration.checks
    assert check.trace().tok_s(times) == pytest.approx(check.tok_s, rel=0.03)


def test_a_decode_only_setting_shares_its_prefill_constants_and_must_say_where_from():
    """FP8 KV changes the decode forward alone: its calibration takes the default's prefill constants."""
    kv = CALIBRATIONS["qwen3.5-35b-a3b-fp8/kv=fp8_e4m3"]
    default = CALIBRATIONS["qwen3.5-35b-a3b-fp8"].times()
    times = kv.times()
    assert (times.prefill_step_ms, times.prefill_token_ms) == (default.prefill_step_ms, default.prefill_token_ms)
    assert times.decode_position_ms < default.decode_position_ms  # one byte a KV value, not two
    assert kv.rows == 656
    with pytest.raises(ValueError, match="two jobs or"):
        Calibration(kv.decode)  # neither fitted nor shared
    with pytest.raises(ValueError, match="two jobs or"):
        Calibration(kv.decode, fit=CALIBRATIONS["qwen3.5-35b-a3b-fp8"].fit, prefill_of="qwen3.5-35b-a3b-fp8")
