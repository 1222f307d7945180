"""The FP8 MoE presets: qwen3.5-35b-a3b-fp8 and qwen3.5-122b-a10b(-fp8) have the published shapes,
and their routed experts (and shared expert) are kept FP8, the layout the grouped FP8 GEMM runs."""
import pytest
import torch

from batchinfer.models.fp8_model import written_fp8_params
from batchinfer.models.layers.fp8_linear import Fp8Weight
from batchinfer.models.presets import PRESETS, preset_config
from batchinfer.models.quantization import parse_quantization
from batchinfer.models.qwen3_hybrid import HybridModel


def test_122b_a10b_has_the_published_shapes():
    c = preset_config("qwen3.5-122b-a10b")
    assert (c.num_layers, len(c.gdn_layer_ids), len(c.attn_layer_ids)) == (48, 36, 12)
    assert (c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (3072, 256, 8, 1024)
    assert (c.num_attention_heads, c.num_kv_heads, c.head_dim) == (32, 2, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == \
        (16, 64, 128, 128)
    assert all(c.is_moe_layer(i) for i in range(c.num_layers))
    total = sum(p.numel() for p in HybridModel(c, torch.bfloat16, "meta").parameters())
    assert 121.5e9 < total < 122.5e9  # "122B"


@pytest.mark.parametrize("name, gigabytes", [("qwen3.5-35b-a3b-fp8", 35.7), ("qwen3.5-122b-a10b-fp8", 123.7)])
def test_fp8_moe_presets_keep_the_experts_fp8(name, gigabytes):
    assert parse_quantization(PRESETS[name]) is not None
    config = preset_config(name)
    assert config == preset_config(name.removesuffix("-fp8"))
    model = HybridModel(config, torch.bfloat16, "meta", written_fp8_params(config))
    moe = model.layers[0].mlp
    for weight in (moe.experts_gate_up, moe.experts_down, moe.shared_expert.gate_up, moe.shared_expert.down):
        assert isinstance(weight, Fp8Weight)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    assert abs(size - gigabytes) < 0.5, size  # fits one H200 (141 GB) with room for the caches
