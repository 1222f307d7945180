"""The mixed step's cost model (engine/step_cost.py): the step time it predicts, the prompt tokens it
picks beside the decode rows, the fit of its constants, and the scheduler taking its choice."""
from __future__ import annotations

import random

import pytest

from batchinfer.engine.step_cost import ENV, StepCost, engine_step_cost, fit
from batchinfer.engine.types import Request, SamplingParams
from tests.engine_utils import make_engine, run, tiny_model

# 27B-like at 96 rows of ~9k context: a 31.5 ms memory-bound decode step, 0.067 ms a token of compute.
H200_27B = StepCost(weight_ms=12.0, row_ms=0.2, token_ms=0.067, prefill_overhead_ms=2.0)


def test_step_time_is_the_larger_of_memory_and_compute():
    assert H200_27B.step_ms(0, 96) == pytest.approx(12.0 + 0.2 * 96)
    assert H200_27B.step_ms(8192, 0) == pytest.approx(2.0 + 0.067 * 8192)
    assert H200_27B.step_ms(100, 96) == pytest.approx(2.0 + 12.0 + 0.2 * 96)  # below the ridge: rides free


def test_prompt_tokens_fill_the_decode_step_up_to_its_ridge():
    # Ridge: 0.067 · (P + 96) = 31.2 → P ≈ 369: the largest multiple of 256 below it.
    assert H200_27B.prefill_budget(96, 8096) == 256
    assert H200_27B.prefill_budget(0, 8192) == 8192  # no decode rows: nothing rides, the largest step
    assert H200_27B.prefill_budget(96, 200) == 200  # less than one granule allowed: all of it
    big_rows = StepCost(weight_ms=12.0, row_ms=1.0, token_ms=0.067)  # a 300 ms memory-bound step
    assert big_rows.prefill_budget(288, 8000) == 4096  # free up to the ridge (0.067 · (P + 288) = 300: P ≈ 4,189)
    costly_chunks = StepCost(weight_ms=12.0, row_ms=0.2, token_ms=0.067, prefill_overhead_ms=400.0)
    assert costly_chunks.prefill_budget(96, 8096) == 8096  # a large fixed cost per step: the fewest steps


# Measured on the H200 (16-layer 27B, bf16, `python -m benchmarks.step_cost --layers 16 --reps 5`):
# (prompt tokens, decode rows, ms). Per prompt token beside 96 rows, the steps cost 48 µs at 256,
# 24 at 512, then 19 from 1,024 up: small chunks pay a launch-bound floor the large ones hide.
H200_16_LAYERS = [(0, 16, 5.531), (0, 32, 6.267), (0, 64, 8.065), (0, 96, 9.618), (0, 128, 11.446), (0, 256, 19.054),
                  (256, 0, 12.692), (512, 0, 13.359), (1024, 0, 21.279), (2048, 0, 40.217), (4096, 0, 76.945),
                  (8192, 0, 161.221)]
H200_MIXED_96 = {256: 21.929, 512: 22.114, 1024: 29.118, 2048: 47.814, 4096: 94.167, 8192: 162.222}


def test_the_fit_of_measured_steps_picks_no_chunk_the_measurements_call_costly():
    cost = fit(H200_16_LAYERS)
    assert cost.prefill_overhead_ms == pytest.approx(12.692 - 0.02058 * 256, rel=0.05)
    chosen = cost.prefill_budget(96, 8192)
    measured = {p: (ms - 9.618) / p for p, ms in H200_MIXED_96.items()}
    assert measured[chosen] <= 1.05 * min(measured.values()), (chosen, measured)


def test_fit_recovers_the_constants_from_measured_steps():
    truth = StepCost(weight_ms=11.0, row_ms=0.25, token_ms=0.07, prefill_overhead_ms=3.0)
    samples = [(0, d, truth.step_ms(0, d)) for d in (32, 64, 128, 256)] + \
              [(p, 0, truth.step_ms(p, 0)) for p in (1024, 2048, 4096, 8192)] + \
              [(p, 96, truth.step_ms(p, 96)) for p in (256, 2048)]
    got = fit(samples)
    for name in ("weight_ms", "row_ms", "token_ms", "prefill_overhead_ms"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    with pytest.raises(ValueError):
        fit(samples[:1])


def test_the_environment_sets_the_constants_and_the_cpu_has_none(monkeypatch):
    model = tiny_model()
    monkeypatch.delenv(ENV, raising=False)
    assert engine_step_cost(model, 512, 4096, 1000) is None
    monkeypatch.setenv(ENV, "12,0.2,0.067,2")
    assert engine_step_cost(model, 512, 4096, 1000) == H200_27B
    monkeypatch.setenv(ENV, "12,fast")
    with pytest.raises(ValueError, match=ENV):
        engine_step_cost(model, 512, 4096, 1000)


def test_the_scheduler_cuts_mixed_steps_prompt_tokens_by_the_model(monkeypatch):
    """Long prompts admitted while rows decode: each mixed step carries the model's 256 prompt tokens,
    not the constant budget, and the tokens are those of separate forwards."""
    monkeypatch.setenv(ENV, "12,0.2,0.067,2")
    model = tiny_model()
    rng = random.Random(5)
    requests = [Request(request_id=i, prompt_token_ids=tuple(rng.randrange(model.config.vocab_size)
                                                             for _ in range(rng.randrange(300, 700))),
                        sampling=SamplingParams(max_tokens=6, ignore_eos=True), seed_key=i) for i in range(6)]
    settings = dict(max_running=3, max_batch_tokens=1024, track_interval=4096)
    mixed = make_engine(model, mixed_step=True, **settings)
    schedule, steps = mixed.scheduler.schedule, []
    mixed.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    got = run(mixed, requests)
    monkeypatch.delenv(ENV)
    expected = run(make_engine(model, mixed_step=False, **settings), requests)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in expected.items()}
    beside = [sum(n for _, n in plan.prefill) for plan in steps if plan.decode and plan.prefill]
    assert beside and max(beside) == 256  # cut by the model (the constant allowed 1,024 less the rows)
    alone = [sum(n for _, n in plan.prefill) for plan in steps if plan.prefill and not plan.decode]
    assert alone and max(alone) > 256  # without decode rows a step takes what the budget allows


def test_the_estimate_from_the_model_keeps_whole_chunks_where_the_measurements_do():
    """From bytes, FLOPs and the per-layer prefill overhead: the 16-layer 27B (bf16, 96 rows at 9k)
    gets a chunk the H200 measurements do not call costly, and a MoE model (all experts' bytes,
    3 B active parameters) whole chunks, not the 768–2,560 tokens it got without the overhead."""
    row_bytes = 16 // 4 * 2 * 4 * 256 * 2 * 9216 + 2 * 48 * 16 * 128 * 128 * 2  # 27B/4: KV at 9k + its state
    dense = StepCost.from_model(int(27e9 * 2 / 4), int(27e9 / 4), row_bytes, layers=16)
    measured = {p: (ms - 9.618) / p for p, ms in H200_MIXED_96.items()}
    chosen = dense.prefill_budget(96, 8192)
    assert measured[min(measured, key=lambda p: abs(p - chosen))] <= 1.05 * min(measured.values()), chosen
    moe = StepCost.from_model(int(37e9), int(3.3e9), 20480 * 9216, layers=40)
    for rows in (1, 64, 256):
        assert moe.prefill_budget(rows, 8192 - rows) >= 8192 - rows - 256, rows
    assert StepCost.from_model(int(37e9), int(3.3e9), 20480 * 9216).prefill_budget(64, 8128) <= 2560  # the old estimate
