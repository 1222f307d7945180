"""Model configuration: one frozen `ModelConfig` from a Hugging Face `config.json`.

Supported checkpoints are the GDN-hybrid families. Vision-language checkpoints
(`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`) keep the language
model's fields under `text_config`; we read only that part (the vision tower is ignored).
Defaults mirror transformers' config classes so a sparse config.json means the same here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

# architecture name → model_type it must carry (text-level model_type in brackets for VLMs)
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_ARCH_BY_MODEL_TYPE = {model_type: arch for arch, model_type in SUPPORTED_ARCHITECTURES.items()}
_VLM_MODEL_TYPES = {"qwen3_5", "qwen3_5_moe"}
# Qwen3-Next fuses q|k|v|z and b|a into two projections interleaved per key-head group;
# the Qwen3.5 families store four separate projections.
_FUSED_GDN_MODEL_TYPES = {"qwen3_next"}


class ModelConfigError(ValueError):
    """A config.json we cannot run; the message is one line, fit for a CLI error."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str                      # of the top-level config (qwen3_5 for a VLM checkpoint)
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]         # "linear_attention" (GDN) / "full_attention" per layer
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP: dense SwiGLU, or MoE with a sigmoid-gated shared expert where `is_moe_layer`
    intermediate_size: int
    num_experts: int = 0                 # 0 → every layer dense
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_layers}")
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ModelConfigError(f"unknown layer types {unknown}; expected {LINEAR_ATTENTION!r} / {FULL_ATTENTION!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ModelConfigError(f"rotary dim {self.rotary_dim} (head_dim × partial_rotary_factor) must be even")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError("num_experts_per_tok must be in 1..num_experts")

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q | k | v."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def fused_gdn_projections(self) -> bool:
        """Checkpoint stores Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba`."""
        return self.model_type in _FUSED_GDN_MODEL_TYPES

    @property
    def is_vlm_checkpoint(self) -> bool:
        return self.model_type in _VLM_MODEL_TYPES

    def is_moe_layer(self, layer_id: int) -> bool:
        # Same rule as transformers' Qwen3NextDecoderLayer.
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)


def load_model_config(path: str | Path) -> ModelConfig:
    """`ModelConfig` of a checkpoint directory (or a config.json path)."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"no config.json at {config_file}") from None
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{config_file} is not valid JSON: {err}") from None
    return model_config_from_dict(raw)


def model_config_from_dict(raw: Mapping[str, Any]) -> ModelConfig:
    """`ModelConfig` from a parsed config.json (top level; `text_config` is found here)."""
    from batchinfer.models.quantization import parse_quantization  # imported here: it imports this module

    architecture, model_type = _identify(raw)
    parse_quantization(raw)  # refuses the methods the engine cannot run (one line)
    text = dict(raw.get("text_config") or {}) if model_type in _VLM_MODEL_TYPES else dict(raw)
    get = text.get
    num_layers = int(get("num_hidden_layers", 32))
    is_qwen3_5_moe = model_type.startswith("qwen3_5_moe")
    is_dense = model_type in ("qwen3_5", "qwen3_5_text")
    if get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {get('hidden_act')!r} is not supported (only 'silu')")
    if get("attention_bias", False):
        raise ModelConfigError("attention_bias=true is not supported by this family's loader")
    rope_theta, partial_rotary = _rope_settings(text)
    # A VLM's head is tied by its top-level flag (what transformers' VLM class reads); the
    # text_config's copy is the fallback.
    tied = bool(raw.get("tie_word_embeddings", get("tie_word_embeddings", False)))
    hidden = int(get("hidden_size", 4096))
    heads = int(get("num_attention_heads", 16))
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=int(get("vocab_size", 248320)),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=_layer_types(text, num_layers),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=tied,
        num_attention_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", 2)),
        head_dim=int(get("head_dim") or hidden // heads),
        partial_rotary_factor=partial_rotary,
        rope_theta=rope_theta,
        linear_num_key_heads=int(get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(get("intermediate_size", 0) or 0),
        num_experts=0 if is_dense else int(get("num_experts", 512)),
        num_experts_per_tok=0 if is_dense else int(get("num_experts_per_tok", 10)),
        # Qwen3.5-MoE's router always renormalises its top-k (no config field for it).
        norm_topk_prob=True if is_qwen3_5_moe else bool(get("norm_topk_prob", True)),
        moe_intermediate_size=0 if is_dense else int(get("moe_intermediate_size", 512)),
        shared_expert_intermediate_size=0 if is_dense else int(get("shared_expert_intermediate_size", 512)),
        decoder_sparse_step=1 if is_qwen3_5_moe else int(get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=() if is_qwen3_5_moe else tuple(int(i) for i in (get("mlp_only_layers") or ())),
        max_position_embeddings=int(get("max_position_embeddings", 32768)),
        eos_token_ids=_eos_ids(get("eos_token_id", raw.get("eos_token_id"))),
    )


def _identify(raw: Mapping[str, Any]) -> tuple[str, str]:
    """(architecture, model_type), or a one-line ModelConfigError listing what we support."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    architecture = architectures[0] if architectures else _ARCH_BY_MODEL_TYPE.get(model_type, "")
    expected_type = SUPPORTED_ARCHITECTURES.get(architecture)
    if expected_type is None or (model_type and model_type != expected_type):
        shown = architecture or "<none>"
        raise ModelConfigError(
            f"unsupported architecture {shown!r} (model_type {model_type!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture, expected_type


def _layer_types(text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    interval = int(text.get("full_attention_interval", 4))
    # Every `interval`-th layer (1-based) is full attention, as transformers derives it.
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


def _rope_settings(text: Mapping[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from `rope_parameters` or the legacy top-level keys.

    Only plain RoPE is supported. Qwen3.5's multimodal RoPE (`mrope_section`) reduces to plain
    1-D RoPE when every position is a text position, which is all this toolkit feeds it.
    """
    params = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelConfigError(f"rope type {rope_type!r} is not supported (only plain RoPE)")
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    return theta, partial


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)
