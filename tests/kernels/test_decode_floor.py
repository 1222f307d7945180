"""benchmarks/decode_floor.py: the decode step's GEMM list against the model's actual matrix
products, the non-GEMM byte counts, and the floor's plumbing on the CPU."""
from __future__ import annotations

import argparse
import gc
import math
from collections import Counter

import pytest
import torch

from batchinfer.models.config import model_config_from_dict
from batchinfer.models.presets import PRESETS, random_model
from benchmarks import decode_floor as df
from tests.model_utils import PackedDriver

MOE = dict(PRESETS["tiny"], architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_experts=8,
           num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])


def tiny_model(raw: dict):
    return random_model(model_config_from_dict(raw), torch.float32, "cpu", seed=0)


def recorded_decode_products(model, monkeypatch, batch: int) -> Counter:
    """(name-free) shapes (m, k, n, groups) of every matrix product one real decode step runs."""
    driver = PackedDriver(model, num_state_slots=batch + 1, num_kv_slots=256)
    for s in range(batch):
        driver.add(s, state_slot=s + 1)
    driver.prefill({s: list(range(3 + s, 10 + 2 * s)) for s in range(batch)})
    seen: Counter = Counter()
    linear, grouped = torch.nn.functional.linear, torch._grouped_mm

    def recording_linear(x, weight, bias=None):
        seen[(x.shape[0], weight.shape[1], weight.shape[0], 1)] += 1
        return linear(x, weight, bias)

    def recording_grouped(x, weight, offs=None, **kw):  # weight [E, k, n] (the model passes a transposed view)
        seen[(x.shape[0], weight.shape[1], weight.shape[2], weight.shape[0])] += 1
        return grouped(x, weight, offs=offs, **kw)

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    monkeypatch.setattr(torch, "_grouped_mm", recording_grouped)
    driver.decode({s: 5 for s in range(batch)})
    return seen


@pytest.mark.parametrize("raw", [PRESETS["tiny"], MOE], ids=["dense", "moe"])
def test_gemm_list_is_exactly_the_matrix_products_of_a_decode_step(raw, monkeypatch):
    model, batch = tiny_model(raw), 3
    listed = Counter()
    for g in df.decode_gemms(model.config, batch):
        listed[(g.m, g.k, g.n, g.groups)] += g.count
    assert listed == recorded_decode_products(model, monkeypatch, batch)


def gemm_weights(model) -> tuple[int, int]:
    """(elements of the dense matrices every token uses, elements of the MoE expert stacks)."""
    dense = experts = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "embed" or name.endswith("conv_weight"):  # gathered / depthwise, not GEMMs
            continue
        if ".experts_" in name:
            experts += p.numel()
        else:
            dense += p.numel()
    return dense, experts


@pytest.mark.parametrize("raw", [PRESETS["tiny"], MOE], ids=["dense", "moe"])
def test_gemm_flops_are_two_per_weight_a_token_uses_and_every_weight_is_listed(raw):
    model, batch = tiny_model(raw), 5
    config = model.config
    dense, experts = gemm_weights(model)
    gemms = df.decode_gemms(config, batch)
    share = config.num_experts_per_tok / config.num_experts if config.num_experts else 0.0
    assert sum(g.flops for g in gemms) == pytest.approx(2 * batch * (dense + share * experts))
    assert sum(g.weight_elements for g in gemms) == dense + experts  # every matrix, each once
    assert gemms[-1].name == "lm_head" and gemms[-1].out_fp32


def test_attention_reads_a_blocks_shared_prefix_once():
    contexts = [10] * 8 + [7, 7]
    hints = [9, 6, 6, 6, 6, 6, 6, 4, 7, 5]  # row 0's hint is ignored; block 0 shares min(6.., 4) = 4
    assert df.attention_kv_positions(contexts, hints, block_rows=8) == 4 + 8 * 6 + 5 + 2 * 2
    assert df.attention_kv_positions(contexts, None) == sum(contexts)
    assert df.attention_kv_positions([3, 3], [0, 9], block_rows=2) == 3  # a hint past a context is capped
    assert df.attention_kv_positions([5], [0], block_rows=8) == 5  # a one-row block shares nothing


def test_state_and_kv_bytes_follow_the_cache_layout():
    config = model_config_from_dict(PRESETS["tiny"])  # 3 GDN + 1 attention layers
    H_k, H_v, d_k, d_v = (config.linear_num_key_heads, config.linear_num_value_heads,
                          config.linear_key_head_dim, config.linear_value_head_dim)
    contexts = [20, 30]
    recurrent = df.decode_bytes_breakdown(config, contexts, replay=False, dtype=torch.bfloat16)
    assert recurrent["state"] == 3 * 2 * (2 * H_v * d_k * d_v * 4)  # fp32 read + write
    assert recurrent["kv"] == 1 * 50 * (2 * config.num_kv_heads * config.head_dim * 2 + 8)
    # ReplaySSM, ring of 1: per step the bf16 checkpoint read, no live entry, one entry written,
    # the key-dot scratch, and the flush every step (checkpoint read + write + the entry).
    entry = (H_k * d_k + H_v * d_v) * 2 + H_v * 4
    per_row = H_v * d_k * d_v * 2 + entry + H_k * 2 * 4 * 2 + (2 * H_v * d_k * d_v * 2 + entry)
    replay = df.decode_bytes_breakdown(config, contexts, replay=True, dtype=torch.bfloat16, ring_len=1)
    assert replay["state"] == pytest.approx(3 * 2 * per_row)
    assert replay["state_flush"] == pytest.approx(3 * 2 * (2 * H_v * d_k * d_v * 2 + entry))
    assert recurrent["state_flush"] == 0
    fp32_ckpt = df.decode_bytes_breakdown(config, contexts, replay=True, dtype=torch.float32, ring_len=1)
    assert fp32_ckpt["state"] > replay["state"]  # an fp32 model keeps fp32 checkpoints (the engine's default)
    parts = [v for k, v in recurrent.items() if k.startswith("other_")]
    assert recurrent["other"] == pytest.approx(sum(parts))


def test_floor_times_every_gemm_through_the_hook_once_and_sums_its_parts():
    model = tiny_model(PRESETS["tiny"])
    built = []

    def counting_gemm(gemm, dtype, device):
        built.append(gemm.name)
        return df.matmul_gemm(gemm, dtype, device)

    meter = df.FloorMeter(torch.device("cpu"), gemm_fn=counting_gemm, reps=2, warmup=1)
    contexts, hints = df.grouped_contexts(4, 16, shared_prefix=8, group_rows=2)
    floor = df.decode_floor(model, contexts, replay=True, shared_with_prev=hints, meter=meter)
    assert sorted(built) == sorted(g.name for g in df.decode_gemms(model.config, 4))
    assert floor["floor_ms"] == pytest.approx(floor["gemm_ms"] + floor["state_ms"] + floor["kv_ms"] + floor["other_ms"])
    assert floor["gemm_ms"] == pytest.approx(sum(floor["gemms"].values())) and floor["copy_bandwidth"] > 0
    assert math.isclose(floor["kv_ms"], 1e3 * floor["bytes"]["kv"] / floor["copy_bandwidth"])
    meter.floor(model, contexts, replay=False)
    assert len(built) == len(df.decode_gemms(model.config, 4))  # same shapes: timings reused


def test_moe_experts_time_through_the_grouped_gemm():
    model = tiny_model(MOE)
    meter = df.FloorMeter(torch.device("cpu"), reps=1, warmup=0)
    floor = meter.floor(model, [12] * 4, replay=False)
    assert floor["gemms"]["moe.experts_gate_up"] > 0 and floor["other_ms"] > 0


def test_decode_rows_log_picks_the_full_batch_step_of_median_context():
    class Runner:
        def decode(self, rows):
            return len(rows.positions)

    class Rows:
        def __init__(self, positions, shared):
            self.positions, self.shared_with_prev = positions, shared

    runner = Runner()
    log = df.record_decode_rows(runner)
    assert runner.decode(Rows([4, 4], [0, 2])) == 2  # passes through
    for positions in ([9, 9, 9], [1, 1, 1], [5, 5, 5]):
        runner.decode(Rows(positions, [0, 1, 1]))
    assert log.full_batch_rows() == ([6, 6, 6], [0, 1, 1])  # positions + 1, the median of three


def test_engine_arms_prints_the_floor_and_frees_the_engine_first(monkeypatch):
    from batchinfer.engine.engine import Engine
    from benchmarks import engine_arms

    alive_at_free = []

    def checking_free(device):
        gc.collect()
        alive_at_free.append(sum(type(o) is Engine for o in gc.get_objects()))

    monkeypatch.setattr(engine_arms, "_free", checking_free)
    model, _ = engine_arms.build_model("tiny", 4, "cpu")
    args = argparse.Namespace(device="cpu", no_graphs=True, max_running=8, max_batch_tokens=256,
                              budget_bytes=None, preset="tiny", floor=True)
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    result = engine_arms.run_arm(model, "replay+extra_buffer", prompts, 3, args)
    assert alive_at_free == [0]
    assert result["floor"]["batch"] == result["full_batch"] == 4
    assert result["step_x_floor"] == pytest.approx(result["full_batch_median_ms"] / result["floor_ms"])
    engine_arms.print_table([{"workload": "rag", **result}])


def test_fp8_floor_times_the_fp8_gemm_for_dense_projections_only(monkeypatch):
    """An FP8 model's floor: aligned dense projections through the FP8 block GEMM (their unaligned
    tail rows, e.g. GDN b|a, in the model dtype); lm_head stays a matmul, the experts are not
    fp8_gemm calls (next test)."""
    import batchinfer.kernels.fp8_gemm as fp8
    from benchmarks.decode_floor import Gemm, fp8_gemm_builder

    calls = []
    real = fp8.fp8_gemm
    monkeypatch.setattr(fp8, "fp8_gemm", lambda x, q, s, *a: calls.append((tuple(x.shape), tuple(q.shape))) or real(x, q, s, *a))
    cpu = torch.device("cpu")
    out, tail = fp8_gemm_builder(Gemm("gdn.in_proj", 4, 256, 256 + 8), torch.float32, cpu)()
    assert calls == [((4, 256), (256, 256))] and tuple(out.shape) == (4, 256) and tuple(tail.shape) == (4, 8)
    assert tuple(fp8_gemm_builder(Gemm("lm_head", 4, 256, 300, out_fp32=True), torch.float32, cpu)().shape) == (4, 300)
    fp8_gemm_builder(Gemm("moe.experts_down", 8, 128, 128, groups=4), torch.float32, cpu)()
    assert len(calls) == 1


def test_fp8_floor_times_the_experts_as_the_models_grouped_fp8_gemms_once(monkeypatch):
    """gate_up and down of an FP8 model's experts are one `ops.moe_fp8` call, timed under gate_up
    with the m rows spread evenly over the experts; down times nothing. Unaligned intermediates
    (no FP8 experts in the model) stay grouped matmuls."""
    from batchinfer.kernels import ops
    from benchmarks.decode_floor import Gemm, fp8_gemm_builder

    calls = []
    real = ops.moe_fp8
    monkeypatch.setattr(ops, "moe_fp8", lambda x, token_of, ends, w13, *a: calls.append(
        (tuple(x.shape), ends.tolist(), tuple(w13.shape))) or real(x, token_of, ends, w13, *a))
    cpu = torch.device("cpu")
    out = fp8_gemm_builder(Gemm("moe.experts_gate_up", 10, 256, 256, groups=4), torch.float32, cpu)()
    assert calls == [((10, 256), [3, 6, 8, 10], (4, 256, 256))] and tuple(out.shape) == (10, 256)
    assert fp8_gemm_builder(Gemm("moe.experts_down", 10, 128, 256, groups=4), torch.float32, cpu)() is None
    unaligned = fp8_gemm_builder(Gemm("moe.experts_gate_up", 8, 64, 96, groups=4), torch.float32, cpu)()
    assert len(calls) == 1 and unaligned is not None


def test_in_order_check_multiplies_by_exactly_the_dense_step_gemms_in_layer_order():
    model = random_model(model_config_from_dict(PRESETS["tiny"]), torch.bfloat16, "cpu", seed=0)
    weights = df.step_weights(model)
    listed = Counter()
    for g in df.decode_gemms(model.config, 4):
        listed[(g.k, g.n)] += g.count
    assert Counter((w.shape[1], w.shape[0]) for _, w in weights) == listed
    names = [name for name, _ in weights]
    assert names[-1] == "lm_head" and names.index("layers.1.mixer.in_proj") < names.index("layers.2.mixer.in_proj")
