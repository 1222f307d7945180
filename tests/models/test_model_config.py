"""config.json → ModelConfig for every supported family, and one-line errors for the rest."""
from __future__ import annotations

import json

import pytest
import torch

from batchinfer.models import (
    PRESETS,
    SUPPORTED_ARCHITECTURES,
    HybridModel,
    ModelConfigError,
    load_model_config,
    model_config_from_dict,
    preset_config,
)

TEXT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, intermediate_size=48)


def test_layer_pattern_from_full_attention_interval():
    cfg = model_config_from_dict({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                                  **TEXT, "full_attention_interval": 4})
    assert cfg.attn_layer_ids == (3, 7)
    assert cfg.gdn_layer_ids == (0, 1, 2, 4, 5, 6)
    assert cfg.conv_dim == 2 * 2 * 8 + 4 * 8
    assert cfg.num_experts == 0 and not cfg.is_moe_layer(0)


def test_explicit_layer_types_win():
    types = ["full_attention", "linear_attention"] * 4
    cfg = model_config_from_dict({"model_type": "qwen3_5_text", **TEXT, "layer_types": types})
    assert cfg.architecture == "Qwen3_5ForCausalLM"  # inferred from model_type when absent
    assert cfg.attn_layer_ids == (0, 2, 4, 6)


def test_vlm_reads_text_config_and_top_level_tie_wins():
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": True, "vision_config": {"depth": 2},
           "text_config": {**TEXT, "model_type": "qwen3_5_text", "eos_token_id": 7, "tie_word_embeddings": False,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                               "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}}}
    cfg = model_config_from_dict(raw)
    assert cfg.is_vlm_checkpoint and cfg.hidden_size == 32 and cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim) == (5e6, 0.5, 8)
    assert cfg.eos_token_ids == (7,)


def test_qwen3_next_moe_fields_and_legacy_rope_keys():
    raw = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **TEXT,
           "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False, "moe_intermediate_size": 24,
           "shared_expert_intermediate_size": 40, "decoder_sparse_step": 2, "mlp_only_layers": [5],
           "rope_theta": 1e7, "partial_rotary_factor": 0.25, "eos_token_id": [1, 2]}
    cfg = model_config_from_dict(raw)
    assert cfg.fused_gdn_projections and cfg.rope_theta == 1e7 and cfg.rotary_dim == 4
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (16, 4, False)
    # MoE where (i + 1) % 2 == 0, except layer 5 (mlp_only_layers)
    assert [cfg.is_moe_layer(i) for i in range(8)] == [False, True, False, True, False, False, False, True]
    assert cfg.eos_token_ids == (1, 2)


def test_qwen3_5_moe_always_renormalises_and_is_all_moe():
    raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": {**TEXT, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                           "shared_expert_intermediate_size": 16, "norm_topk_prob": False}}
    cfg = model_config_from_dict(raw)
    assert cfg.norm_topk_prob and all(cfg.is_moe_layer(i) for i in range(8))
    assert not cfg.fused_gdn_projections


@pytest.mark.parametrize("raw, fragment", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unsupported architecture 'LlamaForCausalLM'"),
    ({"model_type": "mamba"}, "unsupported architecture '<none>'"),
    ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_5_text"}, "unsupported architecture"),
    ({"model_type": "qwen3_5_text", **TEXT, "rope_parameters": {"rope_type": "yarn", "factor": 4}}, "rope type 'yarn'"),
    ({"model_type": "qwen3_5_text", **TEXT, "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen3_5_text", **TEXT, "layer_types": ["linear_attention"]}, "layer_types: has 1"),
])
def test_unsupported_configs_raise_one_line_errors(raw, fragment):
    with pytest.raises(ModelConfigError) as err:
        model_config_from_dict(raw)
    message = str(err.value)
    assert fragment in message and "\n" not in message
    if "unsupported architecture" in fragment:
        assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_load_model_config_reads_directory_and_reports_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", **TEXT}))
    assert load_model_config(tmp_path).num_layers == 8
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model_config(tmp_path / "nowhere")


@pytest.mark.parametrize("name, billions", [("qwen3.5-27b", 26.9), ("qwen3-next-80b-a3b", 79.7)])
def test_presets_have_the_published_sizes(name, billions):
    """Counted on the meta device: the real shapes, no memory."""
    cfg = preset_config(name)
    model = HybridModel(cfg, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / 1e9 - billions) < 0.2, total
    assert len(cfg.attn_layer_ids) * 4 == cfg.num_layers  # 3 GDN : 1 attention


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ModelConfigError, match="tiny"):
        preset_config("nope")
    assert set(PRESETS) == {"tiny", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "qwen3.5-122b-a10b",
                            "qwen3.5-27b-fp8", "qwen3-next-80b-a3b-fp8", "qwen3.5-35b-a3b-fp8",
                            "qwen3.5-122b-a10b-fp8", "qwen3.5-397b-a17b", "qwen3.5-397b-a17b-fp8"}
