"""Named random-weight models at real shapes, built directly on the device.

Each preset is a Hugging Face-style config dict (so it goes through the same config parsing
as a checkpoint); weights are drawn on the target device in the target dtype, deterministic
by seed. `build_model` takes a preset name or a checkpoint directory.

Sizes in bf16: qwen3.5-27b ≈ 54 GB (fits one H200); qwen3.5-35b-a3b ≈ 70 GB (fits; ~3B parameters
active per token); qwen3-next-80b-a3b ≈ 160 GB and qwen3.5-122b-a10b ≈ 244 GB, which do not fit
one GPU — they run as pipeline stages over several (`pipeline_stages`, models/pipeline.py), and
their FP8 twins fit one (80 GB, 124 GB); qwen3.5-397b-a17b ≈ 794 GB (~400 GB in FP8) runs only
as pipeline stages.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from batchinfer.models.config import ModelConfig, ModelConfigError, model_config_from_dict
from batchinfer.models.loader import load_model
from batchinfer.models.qwen3_hybrid import HybridModel
from batchinfer.models.quantization import parse_quantization
from batchinfer.models.random_init import init_random_, make_generator

def _qwen35_moe(*, moe_intermediate_size: int, **sizes: Any) -> dict[str, Any]:
    """A Qwen3.5 MoE text model's config: what the family shares, then the model's own sizes (the
    shared expert as wide as a routed one)."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 248320,
        "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
        "moe_intermediate_size": moe_intermediate_size, "shared_expert_intermediate_size": moe_intermediate_size,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "max_position_embeddings": 262144, **sizes,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "full_attention_interval": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "max_position_embeddings": 4096,
    },
    "qwen3.5-27b": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "full_attention_interval": 4, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "max_position_embeddings": 262144,
    },
    # Qwen/Qwen3.5-35B-A3B's text model: 40 layers (30 GDN + 10 attention), every layer MoE.
    "qwen3.5-35b-a3b": _qwen35_moe(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, linear_num_value_heads=32,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512),
    # Qwen/Qwen3.5-122B-A10B's text model: 48 layers (36 GDN + 12 attention), every layer MoE.
    "qwen3.5-122b-a10b": _qwen35_moe(
        hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, linear_num_value_heads=64,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024),
    # Qwen/Qwen3.5-397B-A17B's text model: 60 layers (15 x (3 GDN + 1 attention)), every layer MoE with
    # 512 experts (10 routed + 1 shared, 1024 wide). The numbers are the Hugging Face model card's as
    # restated by https://apxml.com/models/qwen35-397b-a17b and
    # https://roboaidigest.com/posts/2026-02-17-qwen3-5-397b-moe (hidden 4096; 32 q / 2 kv heads of 256;
    # GDN 16 qk / 64 v heads of 128; vocab 248320; rope theta 1e7); config.json itself was not found,
    # so partial_rotary_factor and the rest follow the 122B's. ~397 B parameters: ~794 GB in bf16.
    "qwen3.5-397b-a17b": _qwen35_moe(
        hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, linear_num_value_heads=64,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024),
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
        "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False, "max_position_embeddings": 262144,
    },
}


# FP8 twins (Qwen's block-quantized format): random weights quantized on the device. ~28 GB
# (27B), ~36 GB (35B-A3B), ~80 GB (80B-A3B) and ~124 GB (122B-A10B): each fits one H200.
# On the CPU their weights are dequantized.
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128], "modules_to_not_convert": []}
PRESETS["qwen3.5-27b-fp8"] = {**PRESETS["qwen3.5-27b"], "quantization_config": FP8_QUANTIZATION}
PRESETS["qwen3-next-80b-a3b-fp8"] = {**PRESETS["qwen3-next-80b-a3b"], "quantization_config": FP8_QUANTIZATION}
PRESETS["qwen3.5-35b-a3b-fp8"] = {**PRESETS["qwen3.5-35b-a3b"], "quantization_config": FP8_QUANTIZATION}
PRESETS["qwen3.5-122b-a10b-fp8"] = {**PRESETS["qwen3.5-122b-a10b"], "quantization_config": FP8_QUANTIZATION}
# ~400 GB: fits 4 H200s as pipeline stages (pipeline_stages: 4), or 2 stages with its layers cut.
PRESETS["qwen3.5-397b-a17b-fp8"] = {**PRESETS["qwen3.5-397b-a17b"], "quantization_config": FP8_QUANTIZATION}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return model_config_from_dict(PRESETS[name])


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> HybridModel:
    """A model of `config` with deterministic random weights drawn on `device` in `dtype`."""
    model = HybridModel(config, dtype, device)
    generator = make_generator(seed, device)
    for name, param in model.named_parameters():  # fixed order → same weights for the same seed
        init_random_(param.data, name, config.num_layers, generator)
    return model


def build_model(preset_or_path: str | Path, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu", seed: int = 0) -> HybridModel:
    """A preset name (random weights) or a checkpoint directory (loaded weights)."""
    if str(preset_or_path) in PRESETS:
        if parse_quantization(PRESETS[str(preset_or_path)]) is not None:
            return random_preset_fp8(preset_config(str(preset_or_path)), dtype, device, seed)
        return random_model(preset_config(str(preset_or_path)), dtype, device, seed)
    return load_model(preset_or_path, dtype, device)


def random_preset_fp8(config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> HybridModel:
    """An FP8 preset: FP8 projections on CUDA; elsewhere the same weights dequantized (as the loader does)."""
    from batchinfer.models.fp8_model import dequantized_model, random_fp8_model  # imports the loader's model

    model = random_fp8_model(config, dtype, device, seed)
    return model if torch.device(device).type == "cuda" else dequantized_model(model, dtype)
