"""The benchmark helpers whose output goes into docs/BENCHMARKS.md: clock samples and the
full-batch step median of benchmarks/engine_arms.py."""
from __future__ import annotations

import math
import os
import time

from benchmarks.engine_arms import full_batch_steps
from benchmarks.gpu_clocks import ClockSampler, parse_samples


def test_clock_lines_parse_and_bad_lines_are_skipped():
    text = "1530, 640.19, 0x0000000000000004\n1455, [N/A], 0x0\n1560, 601.4, 0x0000000000000000\n15"
    samples = parse_samples(text)
    assert samples == [(1530.0, 640.19, "0x0000000000000004"), (1560.0, 601.4, "0x0000000000000000")]


def fake_nvidia_smi(folder, monkeypatch):
    """An `nvidia-smi` on PATH that prints two samples, marks that it ran, and waits to be stopped."""
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '1500, 600.5, 0x4'\necho '1700, 650.5, 0x0'\n"
                      f"touch {folder / 'ran'}\nexec sleep 30\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder / "ran"


def test_sampler_reads_nvidia_smi_and_a_disabled_one_never_starts_it(tmp_path, monkeypatch):
    ran = fake_nvidia_smi(tmp_path, monkeypatch)
    with ClockSampler() as clocks:
        deadline = time.monotonic() + 10
        while not ran.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert clocks.samples == [(1500.0, 600.5, "0x4"), (1700.0, 650.5, "0x0")]
    assert (clocks.mean_mhz, clocks.mean_watts) == (1600.0, 625.5)
    ran.unlink()
    with ClockSampler(enabled=False) as clocks:
        time.sleep(0.2)
    assert not ran.exists() and clocks.samples == []
    assert math.isnan(clocks.mean_mhz) and math.isnan(clocks.mean_watts) and clocks.summary() == ""


class _Timer:
    def __init__(self, steps):
        self.steps = steps


def test_full_batch_median_uses_only_decode_only_steps_at_the_largest_batch():
    steps = [
        {"decode_batch": 4, "prefill_seqs": 2, "total": 9.0, "decode_context": 1},  # mixed with prefill: out
        {"decode_batch": 4, "prefill_seqs": 0, "total": 0.030, "decode_context": 400},
        {"decode_batch": 4, "prefill_seqs": 0, "total": 0.034, "decode_context": 404},
        {"decode_batch": 4, "prefill_seqs": 0, "total": 0.500, "decode_context": 408},  # a flush step: the median ignores it
        {"decode_batch": 3, "prefill_seqs": 0, "total": 0.001, "decode_context": 2},  # the tail: smaller batch, out
        {"decode_batch": 0, "prefill_seqs": 1, "total": 1.0, "decode_context": 0},
    ]
    asked = []

    def roofline_ms(batch, context):
        asked.append((batch, context))
        return 17.0

    report = full_batch_steps(_Timer(steps), roofline_ms)
    assert report["full_batch"] == 4 and report["full_batch_steps"] == 3
    assert math.isclose(report["full_batch_median_ms"], 34.0)
    assert asked == [(4, 404)]  # the roofline of those steps: their batch, their median context
    assert math.isclose(report["full_batch_x_roofline"], 2.0)
    assert full_batch_steps(_Timer([{"decode_batch": 0, "prefill_seqs": 1, "total": 1.0}]), roofline_ms) == {}


def test_run_arm_releases_its_engine_before_freeing_memory(monkeypatch):
    """The next arm's engine sizes its pools from the free memory, so run_arm must drop every
    reference to its engine before it frees: a step timer keeps one (wrapped methods hold the
    engine), and then the second arm fits a tenth of the requests and runs out of memory."""
    import argparse
    import gc

    from batchinfer.engine.engine import Engine
    from benchmarks import engine_arms

    alive_at_free = []

    def checking_free(device):
        gc.collect()
        alive_at_free.append(sum(type(o) is Engine for o in gc.get_objects()))  # type(): no __class__ lookups

    monkeypatch.setattr(engine_arms, "_free", checking_free)
    model, _ = engine_arms.build_model("tiny", 4, "cpu")
    args = argparse.Namespace(device="cpu", no_graphs=True, max_running=8, max_batch_tokens=256,
                              budget_bytes=None, preset="tiny")
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    result = engine_arms.run_arm(model, "replay+extra_buffer", prompts, 3, args)
    assert result["samples"] == 4
    assert alive_at_free == [0]


def test_generation_spec_parses_batch_and_engine_overrides_and_names_a_wrong_field():
    import pytest

    from benchmarks.long_context import AUTO, parse_generation

    assert parse_generation("48x8192x1024") == (48, 8192, 1024, None, {})
    assert parse_generation("48x8192x1024@auto") == (48, 8192, 1024, AUTO, {})
    count, length, output, running, overrides = parse_generation("96x8192x1024@96/track_interval=256/cuda_graphs=0")
    assert (count, length, output, running) == (96, 8192, 1024, 96)
    assert overrides == {"track_interval": 256, "cuda_graphs": False}
    assert type(overrides["cuda_graphs"]) is bool
    assert parse_generation("8x64x8/max_batch_tokens=32768/kv_cache_dtype=fp8_e4m3")[4] == {
        "max_batch_tokens": 32768, "kv_cache_dtype": "fp8_e4m3"}
    with pytest.raises(AttributeError, match="no_such_field"):
        parse_generation("1x8x8/no_such_field=1")
    assert parse_generation("1x8x8/env.SOME_SWITCH=1/max_batch_tokens=64")[4] == {
        "env.SOME_SWITCH": "1", "max_batch_tokens": 64}


def test_print_table_rules_the_header_and_time_ms_counts_its_cpu_calls(capsys):
    from benchmarks.bench_utils import print_table, time_ms

    print_table("a   b", ["1   2", "3   4"])
    assert capsys.readouterr().out == "a   b\n-----\n1   2\n3   4\n"
    calls = []
    assert time_ms(lambda: calls.append(1), "cpu", cpu_calls=3) >= 0 and len(calls) == 4  # one untimed first


def test_a_generation_row_runs_with_a_string_engine_field_and_names_it():
    from benchmarks.engine_arms import build_model
    from benchmarks.long_context import generation_row, parse_generation, parse_policy

    model, _ = build_model("tiny", 4, "cpu")
    count, length, output, running, overrides = parse_generation("2x48x4/kv_cache_dtype=fp8_e4m3")
    row = generation_row(model, parse_policy("triton", 1024), count, length, output, "cpu", "tiny", 32,
                         running, overrides)
    assert row["workload"] == "2x48 → 4 kv_cache_dtype=fp8_e4m3" and row["total_tps"] > 0


def test_a_generation_row_sets_its_environment_for_that_job_alone(monkeypatch):
    from benchmarks import long_context
    from benchmarks.engine_arms import build_model

    seen = []
    real_run_arm = long_context.run_arm

    def run_arm(*args, **kwargs):
        seen.append(os.environ.get("BATCHINFER_TEST_SWITCH"))
        return real_run_arm(*args, **kwargs)

    monkeypatch.setattr(long_context, "run_arm", run_arm)
    monkeypatch.delenv("BATCHINFER_TEST_SWITCH", raising=False)
    model, _ = build_model("tiny", 4, "cpu")
    count, length, output, running, overrides = long_context.parse_generation("2x48x4/env.BATCHINFER_TEST_SWITCH=1")
    row = long_context.generation_row(model, long_context.parse_policy("triton", 1024), count, length, output, "cpu",
                                      "tiny", 32, running, overrides)
    assert seen == ["1"] and "BATCHINFER_TEST_SWITCH" not in os.environ  # set for the job, then removed
    assert row["workload"] == "2x48 → 4 env.BATCHINFER_TEST_SWITCH=1"


def test_step_cost_times_the_two_forwards_in_turn_and_at_once_on_the_cpu():
    from benchmarks.step_cost import OverlapSample, main

    text = main(["--preset", "tiny", "--device", "cpu", "--tokens", "16,32", "--rows", "2,4", "--mixed-rows", "4",
                 "--context", "40", "--reps", "1", "--concurrent"])
    rows = [line for line in text.splitlines() if line.startswith("| 32 | 4 |")]
    assert len(rows) == 2  # the fit's mixed sample and the overlap table's row
    cells = [float(c) for c in rows[1].strip("|").split("|")[2:]]
    assert len(cells) == 8 and all(c > 0 for c in cells[:5]) and min(cells[6:]) > 0
    # hidden = (in turn − at once) / the shorter forward
    assert OverlapSample(8, 96, prefill_ms=20.0, decode_ms=10.0, in_turn_ms=30.0, at_once_ms=24.0).hidden == 0.6
