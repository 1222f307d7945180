"""engine_arms' MoE floors: a decode step reads (and multiplies by) only the routed experts."""
import pytest
import torch

from benchmarks.engine_arms import decode_bytes, decode_flops, expected_unique_experts
from tests.engine_utils import tiny_moe_model


def _moe_model():
    return tiny_moe_model(torch.bfloat16)


def test_expected_unique_experts():
    assert expected_unique_experts(256, 8, 1) == pytest.approx(8)
    assert expected_unique_experts(256, 8, 16) == pytest.approx(256 * (1 - (31 / 32) ** 16))  # ≈ 101
    assert expected_unique_experts(256, 8, 10_000) == pytest.approx(256)


def test_decode_bytes_count_only_routed_experts():
    model = _moe_model()
    per_expert = sum(p[0].numel() * p.element_size() for n, p in model.named_parameters() if ".experts_" in n)
    one = decode_bytes(model, True, 1, 0)
    many = decode_bytes(model, True, 10_000, 0)
    # From batch 1 (2 experts a layer) to a batch that routes to all 16: 14 more experts' weights per
    # layer, plus the per-sequence GDN state of the extra sequences.
    gdn = decode_bytes(model, True, 10_000, 0) - decode_bytes(model, True, 9_999, 0)
    assert many - one == pytest.approx(per_expert * 14 + gdn * 9_999, rel=1e-6)


def test_decode_flops_count_k_experts_per_sequence(monkeypatch):
    import benchmarks.engine_arms as arms

    model = _moe_model()
    k = model.config.num_experts_per_tok
    per_expert = sum(p[0].numel() for n, p in model.named_parameters() if ".experts_" in n)
    with_experts = decode_flops(model, 3, 0)
    monkeypatch.setattr(arms, "_expert_stacks", lambda _model, **_: [])
    assert with_experts - decode_flops(model, 3, 0) == pytest.approx(2 * 3 * k * per_expert)


def test_decode_bytes_count_an_fp8_kv_pool_at_one_byte_a_value():
    model = _moe_model()
    c = model.config
    per_token = len(c.attn_layer_ids) * 2 * c.num_kv_heads * c.head_dim  # K and V values a context token
    bf16, fp8 = decode_bytes(model, True, 8, 1000), decode_bytes(model, True, 8, 1000, kv_itemsize=1)
    assert bf16 - fp8 == pytest.approx(per_token * 1000)


def test_an_fp8_models_floors_count_its_routed_experts_too():
    """FP8 stacks are `experts_*.weight` (e4m3) and `.scale_inv`: the bytes of both, only for the
    routed experts; the FLOPs of the weights'."""
    from tests.kernels.test_kernels_moe_fp8 import _tiny_fp8_moe

    model = _tiny_fp8_moe()
    stacks = [(n, p) for n, p in model.named_parameters() if ".experts_" in n]
    assert {n.rsplit(".", 1)[-1] for n, _ in stacks} == {"weight", "scale_inv"}
    per_expert_bytes = sum(p[0].numel() * p.element_size() for _, p in stacks)
    c = model.config  # 4 experts, top-2: from batch 1 (2 experts a layer) to all 4, 2 more a layer
    gdn = decode_bytes(model, True, 10_000, 0) - decode_bytes(model, True, 9_999, 0)
    assert decode_bytes(model, True, 10_000, 0) - decode_bytes(model, True, 1, 0) == pytest.approx(
        2 * per_expert_bytes + gdn * 9_999, rel=1e-6)
    weights = sum(p[0].numel() for n, p in stacks if n.endswith(".weight"))
    assert decode_flops(model, 3, 0) - decode_flops(model, 2, 0) > 2 * c.num_experts_per_tok * weights
