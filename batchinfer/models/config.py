"""Model configuration: one frozen `ModelConfig` from a Hugging Face `config.json`.

Supported checkpoints are the GDN-hybrid families. Vision-language checkpoints
(`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`) keep the language
model's fields under `text_config`; we read only that part (the vision tower is ignored).
Defaults mirror transformers' config classes so a sparse config.json means the same here.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

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
    """A config.json we cannot run; the message is one line, fit for a CLI error.

    `key`: the config.json key at fault, when one is (the message then starts `config.json: key:`)."""

    def __init__(self, what: str, key: Optional[str] = None) -> None:
        super().__init__(what if key is None else f"config.json: {key}: {what}")
        self.what = what
        self.key = key


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
        if self.head_dim < 1:  # hidden_size // num_attention_heads when head_dim is not given
            raise ModelConfigError("head_dim (hidden_size // num_attention_heads) must be >= 1")
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


MAX_LAYERS = 65536     # far above any released model; bounds what a config alone makes us build
_MAX_SIZE = 2**31 - 1  # every size ends up in int32 index math somewhere


def load_model_config(path: str | Path) -> ModelConfig:
    """`ModelConfig` of a checkpoint directory (or a config.json path)."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelConfigError(f"no config.json at {config_file}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ModelConfigError(f"cannot read {config_file}: {err}") from None
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{config_file} is not valid JSON: {err}") from None
    return model_config_from_dict(raw)


def model_config_from_dict(raw: Mapping[str, Any]) -> ModelConfig:
    """`ModelConfig` from a parsed config.json (top level; `text_config` is found here).

    Every value is type- and range-checked here, once: a count must be a JSON integer (not a
    bool, float or string) in range, so nothing downstream divides by zero or truncates 8.7."""
    from batchinfer.models.quantization import parse_quantization  # imported here: it imports this module

    if not isinstance(raw, Mapping):
        raise ModelConfigError(f"must hold a JSON object, got a JSON {_json_type(raw)}", key="(top level)")
    architecture, model_type = _identify(raw)
    parse_quantization(raw)  # refuses the methods the engine cannot run (one line)
    if model_type in _VLM_MODEL_TYPES:
        text_config = raw.get("text_config") or {}
        if not isinstance(text_config, Mapping):
            raise ModelConfigError(f"must be an object, got a JSON {_json_type(text_config)}", key="text_config")
        f = _Fields(text_config, "text_config.")
    else:
        f = _Fields(raw)
    num_layers = f.integer("num_hidden_layers", 32, high=MAX_LAYERS)
    is_qwen3_5_moe = model_type.startswith("qwen3_5_moe")
    is_dense = model_type in ("qwen3_5", "qwen3_5_text")
    if f.get("hidden_act", "silu") != "silu":
        raise f.fail("hidden_act", f"{f.get('hidden_act')!r} is not supported (only 'silu')")
    if f.flag("attention_bias", False):
        raise f.fail("attention_bias", "true is not supported by this family's loader")
    rope_theta, partial_rotary = _rope_settings(f)
    # A VLM's head is tied by its top-level flag (what transformers' VLM class reads); the
    # text_config's copy is the fallback.
    tied = (_Fields(raw) if "tie_word_embeddings" in raw else f).flag("tie_word_embeddings", False)
    hidden = f.integer("hidden_size", 4096)
    heads = f.integer("num_attention_heads", 16)
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=f.integer("vocab_size", 248320),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=_layer_types(f, num_layers),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        tie_word_embeddings=tied,
        num_attention_heads=heads,
        num_kv_heads=f.integer("num_key_value_heads", 2),
        head_dim=f.integer("head_dim", None, null=True) or hidden // heads,
        partial_rotary_factor=partial_rotary,
        rope_theta=rope_theta,
        linear_num_key_heads=f.integer("linear_num_key_heads", 16),
        linear_num_value_heads=f.integer("linear_num_value_heads", 32),
        linear_key_head_dim=f.integer("linear_key_head_dim", 128),
        linear_value_head_dim=f.integer("linear_value_head_dim", 128),
        linear_conv_kernel_dim=f.integer("linear_conv_kernel_dim", 4),
        intermediate_size=f.integer("intermediate_size", 0, low=0, null=True) or 0,
        num_experts=0 if is_dense else f.integer("num_experts", 512, low=0),
        num_experts_per_tok=0 if is_dense else f.integer("num_experts_per_tok", 10, low=0),
        # Qwen3.5-MoE's router always renormalises its top-k (no config field for it).
        norm_topk_prob=True if is_qwen3_5_moe else f.flag("norm_topk_prob", True),
        moe_intermediate_size=0 if is_dense else f.integer("moe_intermediate_size", 512, low=0),
        shared_expert_intermediate_size=0 if is_dense else f.integer("shared_expert_intermediate_size", 512, low=0),
        decoder_sparse_step=1 if is_qwen3_5_moe else f.integer("decoder_sparse_step", 1, null=True) or 1,
        mlp_only_layers=() if is_qwen3_5_moe else _mlp_only_layers(f, num_layers),
        max_position_embeddings=f.integer("max_position_embeddings", 32768, low=2),
        eos_token_ids=_eos_ids(f if "eos_token_id" in f.values else _Fields(raw)),
    )


def _shown(value: Any) -> str:
    return json.dumps(value, default=repr)[:80]


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


@dataclass(frozen=True)
class _Fields:
    """Typed reads of one config mapping; errors name the key (`text_config.` + key for a VLM)."""

    values: Mapping[str, Any]
    prefix: str = ""

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def fail(self, key: str, what: str) -> ModelConfigError:
        return ModelConfigError(what, key=self.prefix + key)

    def integer(self, key: str, default: Any, low: int = 1, high: int = _MAX_SIZE, null: bool = False) -> Any:
        """A JSON integer in [low, high]; `null`: a JSON null means the default (transformers derives it)."""
        value = self.values.get(key, default)
        if value is None and null:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {_shown(value)}")
        if not low <= value <= high:
            raise self.fail(key, f"must be in [{low}, {high}], got {value}")
        return value

    def number(self, key: str, default: float, low: float = 0.0, high: float = math.inf) -> float:
        """A finite JSON number in (low, high]."""
        value = self.values.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {_shown(value)}")
        if not low < value <= high:
            raise self.fail(key, f"must be in ({low}, {high}], got {value}")
        return float(value)

    def flag(self, key: str, default: Any) -> Any:
        value = self.values.get(key, default)
        if not isinstance(value, bool):  # "false" as a string would read as true
            raise self.fail(key, f"must be true or false, got {_shown(value)}")
        return value

    def mapping(self, key: str) -> "_Fields":
        value = self.values.get(key) or {}
        if not isinstance(value, Mapping):
            raise self.fail(key, f"must be an object, got a JSON {_json_type(value)}")
        return _Fields(value, f"{self.prefix}{key}.")


def _identify(raw: Mapping[str, Any]) -> tuple[str, str]:
    """(architecture, model_type), or a one-line ModelConfigError listing what we support."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ModelConfigError(f"must be a list of names, got {_shown(architectures)}", key="architectures")
    if not isinstance(model_type, str):
        raise ModelConfigError(f"must be a name, got {_shown(model_type)}", key="model_type")
    architecture = architectures[0] if architectures else _ARCH_BY_MODEL_TYPE.get(model_type, "")
    expected_type = SUPPORTED_ARCHITECTURES.get(architecture)
    if expected_type is None or (model_type and model_type != expected_type):
        shown = architecture or "<none>"
        raise ModelConfigError(
            f"unsupported architecture {shown!r} (model_type {model_type!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture, expected_type


def _layer_types(f: _Fields, num_layers: int) -> tuple[str, ...]:
    types = f.get("layer_types")
    if types:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise f.fail("layer_types", f"must be a list of layer type names, got {_shown(types)}")
        if len(types) != num_layers:
            raise f.fail("layer_types", f"has {len(types)} entries but num_hidden_layers is {num_layers}")
        return tuple(types)
    interval = f.integer("full_attention_interval", 4)
    # Every `interval`-th layer (1-based) is full attention, as transformers derives it.
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


def _mlp_only_layers(f: _Fields, num_layers: int) -> tuple[int, ...]:
    layers = f.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(type(i) is int and 0 <= i < num_layers for i in layers):
        raise f.fail("mlp_only_layers", f"must be a list of layer indices in [0, {num_layers}), "
                                        f"got {_shown(layers)}")
    return tuple(layers)


def _rope_settings(f: _Fields) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from `rope_parameters` or the legacy top-level keys.

    Only plain RoPE is supported. Qwen3.5's multimodal RoPE (`mrope_section`) reduces to plain
    1-D RoPE when every position is a text position, which is all this toolkit feeds it.
    """
    params, scaling = f.mapping("rope_parameters"), f.mapping("rope_scaling")
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelConfigError(f"rope type {rope_type!r} is not supported (only plain RoPE)")
    theta = (params if "rope_theta" in params.values else f).number("rope_theta", 10000.0)
    source = params if "partial_rotary_factor" in params.values else f
    return theta, source.number("partial_rotary_factor", 0.25, high=1.0)


def _eos_ids(f: _Fields) -> tuple[int, ...]:
    value = f.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise f.fail("eos_token_id", f"must be a token id or a list of them, got {_shown(value)}")
    return tuple(ids)
