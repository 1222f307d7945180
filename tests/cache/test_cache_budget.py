"""Pool sizing: bytes per slot/token, the split of a budget, and its failure modes."""
from __future__ import annotations

import pytest
import torch

from batchinfer.cache.budget import build_pools, memory_budget, plan_pools
from batchinfer.cache.shapes import GdnStateShape, KVShape, shapes_from_model_config
from batchinfer.models.config import model_config_from_dict

TINY_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4, "intermediate_size": 64,
}


def test_shapes_from_model_config_and_bytes():
    config = model_config_from_dict(TINY_CONFIG)
    kv, gdn = shapes_from_model_config(config, torch.bfloat16, ring_len=16, ckpt_dtype=torch.bfloat16)
    assert (kv.num_layers, kv.num_kv_heads, kv.head_dim) == (1, 2, 8)
    assert kv.bytes_per_token == 2 * 1 * 2 * 8 * 2
    assert (gdn.num_layers, gdn.conv_dim, gdn.ring_len, gdn.ssm_dtype) == (3, 2 * 16 + 24, 16, torch.bfloat16)
    conv = 56 * 3 * 2
    ssm = 4 * 8 * 6 * 2
    ring = 16 * (2 * 8 * 2 + 4 * 6 * 2 + 4 * 4)
    assert gdn.bytes_per_slot == 3 * (conv + ssm + ring) + 4
    _, recurrent = shapes_from_model_config(config, torch.bfloat16)
    assert recurrent.ssm_dtype == torch.float32 and not recurrent.replay


def test_bytes_match_allocated_tensors():
    kv_shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    state_shape = GdnStateShape(num_layers=3, conv_dim=10, conv_kernel=4, num_k_heads=1, num_v_heads=2,
                                head_k_dim=2, head_v_dim=3, conv_dtype=torch.float16, ssm_dtype=torch.float32,
                                ring_len=5)
    plan = plan_pools(kv_shape, state_shape, budget_bytes=200_000, max_running=4, min_kv_tokens=16)
    kv_pool, state_pool = build_pools(plan, kv_shape, state_shape, "cpu")
    kv_bytes = sum(t.numel() * t.element_size() for t in kv_pool.k + kv_pool.v)
    state_bytes = sum(t.numel() * t.element_size() for group in (state_pool.conv, state_pool.ssm, state_pool.ring_k,
                                                                 state_pool.ring_u, state_pool.ring_g) for t in group)
    state_bytes += state_pool.cursor.numel() * 4
    # +1 row each: the pad slot
    assert kv_bytes == (plan.kv_slots + 1) * kv_shape.bytes_per_token
    assert state_bytes == (plan.state_slots + 1) * state_shape.bytes_per_slot
    assert plan.total_bytes <= 200_000


def _shapes():
    kv = KVShape(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)  # 2 KiB per token
    gdn = GdnStateShape(num_layers=12, conv_dim=512, conv_kernel=4, num_k_heads=2, num_v_heads=4,
                        head_k_dim=64, head_v_dim=64, conv_dtype=torch.bfloat16, ssm_dtype=torch.float32)
    return kv, gdn


def test_plan_fits_requested_running_requests():
    kv, gdn = _shapes()
    budget = 1 << 30
    plan = plan_pools(kv, gdn, budget, max_running=8, slots_per_request=3, cache_states_per_request=1.0)
    assert plan.max_running == 8 and plan.state_slots == 8 * 3 + 8 and plan.cache_state_slots == 8
    assert plan.kv_slots == (budget - plan.state_bytes) // kv.bytes_per_token
    assert budget - kv.bytes_per_token < plan.total_bytes <= budget
    assert "8 running requests" in plan.describe()


def test_default_plan_is_one_working_slot_per_request_plus_a_cache_pool():
    kv, gdn = _shapes()
    plan = plan_pools(kv, gdn, 1 << 30, max_running=64)
    assert plan.max_running == 64 and plan.cache_state_slots == 16 and plan.state_slots == 64 + 16
    small = plan_pools(kv, gdn, 1 << 30, max_running=3)
    assert small.cache_state_slots == 8 and small.state_slots == 3 + 8  # the pool's minimum


@pytest.mark.parametrize("n", [1, 7, 40])
def test_budget_for_n_working_slots_and_a_few_cached_states_runs_n(n):
    """Room for exactly n working slots + the minimum cache pool: n requests, not n / 3."""
    kv, gdn = _shapes()
    state_bytes = (n + 4) * gdn.bytes_per_slot
    budget = 2 * state_bytes + 1  # max_state_fraction 0.5 → exactly n + 4 state slots
    plan = plan_pools(kv, gdn, budget, max_running=1000, cache_states_per_request=0.0, min_cache_states=4)
    assert (plan.max_running, plan.state_slots, plan.cache_state_slots) == (n, n + 4, 4)
    one_slot_less = dict(budget_bytes=budget - 2 * gdn.bytes_per_slot, max_running=1000,
                         cache_states_per_request=0.0, min_cache_states=4)
    if n > 1:
        assert plan_pools(kv, gdn, **one_slot_less).max_running == n - 1
    else:
        with pytest.raises(ValueError, match="cannot hold one request"):
            plan_pools(kv, gdn, **one_slot_less)


def test_plan_shrinks_running_to_the_state_share():
    kv, gdn = _shapes()
    budget = 40 * gdn.bytes_per_slot
    plan = plan_pools(kv, gdn, budget, max_running=100, slots_per_request=3, cache_states_per_request=1.0,
                      min_cache_states=0, max_state_fraction=0.5)
    assert plan.max_running == 5  # 20 slots' worth of state bytes / 4 slots per request
    assert plan.state_bytes <= budget * 0.5
    default = plan_pools(kv, gdn, budget, max_running=100, max_state_fraction=0.5)
    # 20 slots: n + max(8, ⌈n / 4⌉) ≤ 20 → n = 12 (the old 3 slots per request + 1 cached ran 5)
    assert (default.max_running, default.cache_state_slots) == (12, 8)
    quarter = plan_pools(kv, gdn, 200 * gdn.bytes_per_slot, max_running=1000, max_state_fraction=0.5)
    assert (quarter.max_running, quarter.state_slots) == (80, 100)  # 80 + ⌈80 / 4⌉ = 100


def test_plan_rejects_budgets_too_small():
    kv, gdn = _shapes()
    with pytest.raises(ValueError, match="cannot hold one request"):
        plan_pools(kv, gdn, 3 * gdn.bytes_per_slot, max_running=4)
    with pytest.raises(ValueError, match="cannot hold one request"):  # 1 working + 8 cached > 8 slots
        plan_pools(kv, gdn, 16 * gdn.bytes_per_slot, max_running=4)
    with pytest.raises(ValueError, match="KV tokens"):
        plan_pools(kv, gdn, gdn.bytes_per_slot + 10 * kv.bytes_per_token, max_running=1, slots_per_request=1,
                   cache_states_per_request=0, min_cache_states=0, max_state_fraction=0.99, min_kv_tokens=256)


def test_memory_budget_on_cpu_needs_a_total():
    assert memory_budget("cpu", 0.25, cpu_total_bytes=1000) == 250
    with pytest.raises(ValueError):
        memory_budget("cpu", 0.5)


def test_pool_budget_leaves_the_step_activations_free():
    from batchinfer.cache.budget import pool_budget

    gib = 2 ** 30
    # A big device: 90% of the free memory leaves far more than the activations need.
    assert pool_budget(80 * gib, 0.9, reserve_bytes=2 * gib) == int(72 * gib)
    # A nearly full one: the fraction would leave 0.6 GiB for a step that needs 2: the reserve wins.
    assert pool_budget(6 * gib, 0.9, reserve_bytes=2 * gib) == 4 * gib
    with pytest.raises(ValueError, match=r"6\.00 GiB of device memory free, but one step's activations need ~7\.00 GiB"):
        pool_budget(6 * gib, 0.9, reserve_bytes=7 * gib)


def test_step_activation_estimate_counts_its_terms():
    """Hand count for TINY_CONFIG in bf16 (the largest layer is the GDN one here): the per-token
    residual stream and GDN tensors, the M⁻¹ blocks per chunk, and two fp32 logits rows per
    request; the decode graphs: one logits buffer of the largest bucket (shared by all), the
    context buffer and the largest bucket's tensors."""
    from batchinfer.engine.activations import decode_graph_bytes, step_activation_bytes

    config = model_config_from_dict(TINY_CONFIG)
    conv_dim, h_k, h_v, d_v = 2 * 2 * 8 + 4 * 6, 2, 4, 6
    gdn = (2 * conv_dim + 6 * h_v * d_v) * 2 + (h_v + h_k) * 4
    assert gdn > 3 * 64 * 2 and gdn > (4 * 4 * 8 + 2 * 2 * 8) * 2  # larger than the MLP and attention terms
    per_token = 3 * 32 * 2 + gdn
    tokens, running = 512, 16
    expect = tokens * per_token + (tokens // 64 + running) * h_v * 64 * 64 * 2 + 2 * running * 64 * 4
    assert step_activation_bytes(config, torch.bfloat16, tokens, running) == expect
    assert decode_graph_bytes(config, torch.bfloat16, [1, 2, 4, 6], ctx_cap=100) == (
        6 * 64 * 4 + 6 * 100 * 8 + 6 * per_token)
    # Decode rows count as tokens when there are more of them than prefill tokens.
    assert step_activation_bytes(config, torch.bfloat16, 8, running) == step_activation_bytes(
        config, torch.bfloat16, running, running)
