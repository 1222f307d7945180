"""benchmarks/job_bound.py: the bound of a job from FLOPs and bytes, with the engine's own row sizing."""
from __future__ import annotations

import pytest

from benchmarks.job_bound import H200_GIB, ModelCosts, engine_rows, job_bound, main


@pytest.mark.parametrize("preset, rows, fp8_kv_rows", [("qwen3.5-27b", 104, 184), ("qwen3.5-35b-a3b", 272, 456),
                                                       ("qwen3.5-35b-a3b-fp8", 392, 664)])
def test_rows_at_once_are_what_the_engine_sized_on_the_h200(preset, rows, fp8_kv_rows):
    """104, 272 and 392: the max_running the 8k / 1k runs on the H200 printed (docs/BENCHMARKS.md);
    an FP8 KV pool (one byte a value) fits more."""
    costs = ModelCosts.of(preset)
    assert engine_rows(costs, 9216, "auto", H200_GIB)[0] == rows
    assert engine_rows(costs, 9216, "fp8_e4m3", H200_GIB)[0] == fp8_kv_rows


def test_the_fp8_checkpoint_splits_the_same_matrices_by_dtype():
    bf16, fp8 = ModelCosts.of("qwen3.5-27b"), ModelCosts.of("qwen3.5-27b-fp8")
    assert bf16.dense_fp8_params == 0 and fp8.dense_fp8_params > 0.9 * bf16.dense_bf16_params
    assert fp8.dense_bf16_params + fp8.dense_fp8_params == bf16.dense_bf16_params  # block scales are not multiplied
    # bf16: two bytes a parameter; the matrices, both embeddings and the rest (norms, conv) add up
    params = bf16.dense_bf16_params + 2 * bf16.lm_head_params
    assert params * 2 < bf16.total_bytes < params * 2 * 1.01


def test_a_moe_decode_step_reads_the_experts_its_rows_route_to():
    costs = ModelCosts.of("qwen3.5-35b-a3b")
    one, many = costs.streamed_bytes(1), costs.streamed_bytes(256)
    experts = costs.config.num_experts * costs.expert_bytes
    assert one == pytest.approx(costs.dense_bytes + costs.config.num_experts_per_tok * costs.expert_bytes)
    assert costs.dense_bytes + 0.99 * experts < many <= costs.dense_bytes + experts


def test_the_bounds_hold_the_measured_rows_and_order_the_settings():
    """Every throughput the H200 measured is below its in-turn bound; overlap and an FP8 KV only raise it."""
    measured = {("qwen3.5-27b", 96): 8578, ("qwen3.5-27b-fp8", 96): 11301, ("qwen3.5-35b-a3b", 256): 26575,
                ("qwen3.5-35b-a3b-fp8", 256): 39375}
    for (preset, prompts), tok_s in measured.items():
        plain = job_bound(preset, prompts, 8192, 1024)
        fp8_kv = job_bound(preset, prompts, 8192, 1024, kv_cache_dtype="fp8_e4m3")
        assert tok_s < plain.in_turn_tok_s < plain.overlapped_tok_s
        assert plain.in_turn_tok_s < fp8_kv.in_turn_tok_s
        assert plain.rows == prompts  # these jobs run every prompt at once


def test_the_table_names_each_target():
    text = main(["--presets", "qwen3.5-27b", "--prompts", "96", "--kv-cache-dtype", "auto"])
    row = [line for line in text.splitlines() if line.startswith("| qwen3.5-27b |")]
    assert len(row) == 1 and "| 10,600 |" in row[0]


def test_a_cut_preset_and_the_settings_that_ran_move_the_bound():
    """16 of 64 layers: ~4x the rate (the LM head and embedding stay); a smaller step size only adds
    weight reads; the rows that ran replace the sizing."""
    whole, cut = job_bound("qwen3.5-27b", 96, 8192, 1024), job_bound("qwen3.5-27b", 96, 8192, 1024, layers=16)
    assert 3.5 < cut.in_turn_tok_s / whole.in_turn_tok_s < 4.0
    assert job_bound("qwen3.5-27b", 96, 8192, 1024, step_tokens=1024).in_turn_tok_s <= whole.in_turn_tok_s
    assert job_bound("qwen3.5-27b", 288, 8192, 1024, rows=96).rows == 96
