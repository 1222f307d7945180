"""How Hugging Face tensor names and shapes map onto `HybridModel` parameters.

One list of `HfTensor`s describes a checkpoint: its full name, expected shape, and where its
pieces go (parameter name + index). The loader walks it; the checkpoint writer generates
tensors from the same list, so the two cannot drift apart.

Layout variants, detected from the checkpoint's tensor names:
- prefix `model.` (text models) or `model.language_model.` (vision-language checkpoints);
- GDN projections separate (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) or fused
  (Qwen3-Next: in_proj_qkvz / in_proj_ba, interleaved per key-head group: for each of the H_k
  groups, [q (d_k), k (d_k), v (r·d_v), z (r·d_v)] and [b (r), a (r)], r = H_v / H_k);
- MoE experts per expert (`experts.{e}.gate_proj.weight`, as published and as transformers
  saves them) or stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Collection, Optional

import torch

from batchinfer.models.config import ModelConfig

Index = tuple  # index into a parameter: slices and ints, as for tensor[index]


@dataclass(frozen=True)
class Target:
    param: str      # HybridModel parameter name (named_parameters())
    index: Index    # the part of it this piece fills; () = all of it


@dataclass(frozen=True)
class HfTensor:
    name: str                          # full checkpoint name
    shape: tuple[int, ...]             # expected shape
    targets: tuple[Target, ...]        # where the pieces go, in the order `split` returns them
    split: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = None  # None: the whole tensor


@dataclass(frozen=True)
class CheckpointLayout:
    prefix: str               # "model." or "model.language_model."
    fused_gdn: bool
    stacked_experts: bool


LANGUAGE_MODEL_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
# Checkpoint parts this toolkit never runs (vision tower, multi-token-prediction head).
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def detect_layout(config: ModelConfig, names: Collection[str]) -> CheckpointLayout:
    prefix = LANGUAGE_MODEL_PREFIX if any(n.startswith(LANGUAGE_MODEL_PREFIX) for n in names) else TEXT_PREFIX
    has_fused = any(n.endswith("linear_attn.in_proj_qkvz.weight") for n in names)
    has_split = any(n.endswith("linear_attn.in_proj_qkv.weight") for n in names)
    return CheckpointLayout(
        prefix=prefix,
        fused_gdn=has_fused or (not has_split and config.fused_gdn_projections),
        stacked_experts=any(n.endswith("mlp.experts.gate_up_proj") for n in names),
    )


def default_layout(config: ModelConfig) -> CheckpointLayout:
    """The layout transformers writes for this config (used by the checkpoint writer)."""
    return CheckpointLayout(
        prefix=LANGUAGE_MODEL_PREFIX if config.is_vlm_checkpoint else TEXT_PREFIX,
        fused_gdn=config.fused_gdn_projections,
        stacked_experts=False,
    )


def checkpoint_tensors(config: ModelConfig, layout: CheckpointLayout) -> list[HfTensor]:
    """Every tensor the model needs from a checkpoint of this layout."""
    c, p = config, layout.prefix
    tensors = [_whole(f"{p}embed_tokens.weight", (c.vocab_size, c.hidden_size), "embed"),
               _whole(f"{p}norm.weight", (c.hidden_size,), "final_norm")]
    if not c.tie_word_embeddings:
        tensors.append(_whole("lm_head.weight", (c.vocab_size, c.hidden_size), "lm_head"))
    for i in range(c.num_layers):
        hf, ours = f"{p}layers.{i}.", f"layers.{i}."
        tensors += [_whole(hf + "input_layernorm.weight", (c.hidden_size,), ours + "input_norm"),
                    _whole(hf + "post_attention_layernorm.weight", (c.hidden_size,), ours + "post_norm")]
        if i in c.gdn_layer_ids:
            tensors += _gdn_tensors(c, layout, hf + "linear_attn.", ours + "mixer.")
        else:
            tensors += _attention_tensors(c, hf + "self_attn.", ours + "mixer.")
        if c.is_moe_layer(i):
            tensors += _moe_tensors(c, layout, hf + "mlp.", ours + "mlp.")
        else:
            tensors += _swiglu_tensors(hf + "mlp.", ours + "mlp.", c.hidden_size, c.intermediate_size)
    return tensors


def _whole(name: str, shape: tuple[int, ...], param: str) -> HfTensor:
    return HfTensor(name, shape, (Target(param, ()),))


def _rows(start: int, length: int) -> Index:
    return (slice(start, start + length),)


def _gdn_tensors(c: ModelConfig, layout: CheckpointLayout, hf: str, ours: str) -> list[HfTensor]:
    H, K_dim, V_dim, H_v = c.hidden_size, c.gdn_key_dim, c.gdn_value_dim, c.linear_num_value_heads
    proj = ours + "in_proj"  # rows: q | k | v | z | b | a
    q_rows, k_rows, v_rows = _rows(0, K_dim), _rows(K_dim, K_dim), _rows(2 * K_dim, V_dim)
    z_rows = _rows(c.conv_dim, V_dim)
    b_rows, a_rows = _rows(c.conv_dim + V_dim, H_v), _rows(c.conv_dim + V_dim + H_v, H_v)
    if layout.fused_gdn:
        projections = [
            HfTensor(hf + "in_proj_qkvz.weight", (2 * K_dim + 2 * V_dim, H),
                     tuple(Target(proj, r) for r in (q_rows, k_rows, v_rows, z_rows)), _qkvz_splitter(c)),
            HfTensor(hf + "in_proj_ba.weight", (2 * H_v, H),
                     (Target(proj, b_rows), Target(proj, a_rows)), _ba_splitter(c)),
        ]
    else:
        projections = [
            HfTensor(hf + "in_proj_qkv.weight", (c.conv_dim, H), (Target(proj, _rows(0, c.conv_dim)),)),
            HfTensor(hf + "in_proj_z.weight", (V_dim, H), (Target(proj, z_rows),)),
            HfTensor(hf + "in_proj_b.weight", (H_v, H), (Target(proj, b_rows),)),
            HfTensor(hf + "in_proj_a.weight", (H_v, H), (Target(proj, a_rows),)),
        ]
    K = c.linear_conv_kernel_dim
    return projections + [
        HfTensor(hf + "conv1d.weight", (c.conv_dim, 1, K), (Target(ours + "conv_weight", ()),),
                 lambda w: (w.reshape(w.shape[0], w.shape[-1]),)),
        _whole(hf + "A_log", (H_v,), ours + "A_log"),
        _whole(hf + "dt_bias", (H_v,), ours + "dt_bias"),
        _whole(hf + "norm.weight", (c.linear_value_head_dim,), ours + "norm_weight"),
        _whole(hf + "out_proj.weight", (H, V_dim), ours + "out_proj"),
    ]


def _qkvz_splitter(c: ModelConfig) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    groups, d_k = c.linear_num_key_heads, c.linear_key_head_dim
    per_group_v = c.linear_num_value_heads // groups * c.linear_value_head_dim

    def split(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grouped = w.reshape(groups, 2 * d_k + 2 * per_group_v, w.shape[-1])  # [H_k, rows per group, hidden]
        parts = grouped.split([d_k, d_k, per_group_v, per_group_v], dim=1)
        # Group-major order of v and z heads is exactly value-head order (h = g·r + i).
        return tuple(part.reshape(-1, w.shape[-1]) for part in parts)  # q, k, v, z

    return split


def _ba_splitter(c: ModelConfig) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    groups, ratio = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads

    def split(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, a = w.reshape(groups, 2 * ratio, w.shape[-1]).split([ratio, ratio], dim=1)
        return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])

    return split


def _attention_tensors(c: ModelConfig, hf: str, ours: str) -> list[HfTensor]:
    H, d = c.hidden_size, c.head_dim
    q_rows, kv_rows = 2 * c.num_attention_heads * d, c.num_kv_heads * d
    proj = ours + "qkv_proj"  # rows: q+gate (per-head interleave kept) | k | v
    return [
        HfTensor(hf + "q_proj.weight", (q_rows, H), (Target(proj, _rows(0, q_rows)),)),
        HfTensor(hf + "k_proj.weight", (kv_rows, H), (Target(proj, _rows(q_rows, kv_rows)),)),
        HfTensor(hf + "v_proj.weight", (kv_rows, H), (Target(proj, _rows(q_rows + kv_rows, kv_rows)),)),
        _whole(hf + "q_norm.weight", (d,), ours + "q_norm"),
        _whole(hf + "k_norm.weight", (d,), ours + "k_norm"),
        _whole(hf + "o_proj.weight", (H, c.num_attention_heads * d), ours + "o_proj"),
    ]


def _swiglu_tensors(hf: str, ours: str, hidden: int, inter: int) -> list[HfTensor]:
    return [
        HfTensor(hf + "gate_proj.weight", (inter, hidden), (Target(ours + "gate_up", _rows(0, inter)),)),
        HfTensor(hf + "up_proj.weight", (inter, hidden), (Target(ours + "gate_up", _rows(inter, inter)),)),
        _whole(hf + "down_proj.weight", (hidden, inter), ours + "down"),
    ]


def _moe_tensors(c: ModelConfig, layout: CheckpointLayout, hf: str, ours: str) -> list[HfTensor]:
    E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
    tensors = [_whole(hf + "gate.weight", (E, H), ours + "router"),
               _whole(hf + "shared_expert_gate.weight", (1, H), ours + "shared_expert_gate")]
    tensors += _swiglu_tensors(hf + "shared_expert.", ours + "shared_expert.", H, c.shared_expert_intermediate_size)
    if layout.stacked_experts:
        return tensors + [_whole(hf + "experts.gate_up_proj", (E, 2 * I, H), ours + "experts_gate_up"),
                          _whole(hf + "experts.down_proj", (E, H, I), ours + "experts_down")]
    for e in range(E):
        expert = f"{hf}experts.{e}."
        tensors += [
            HfTensor(expert + "gate_proj.weight", (I, H), (Target(ours + "experts_gate_up", (e, slice(0, I))),)),
            HfTensor(expert + "up_proj.weight", (I, H), (Target(ours + "experts_gate_up", (e, slice(I, 2 * I))),)),
            HfTensor(expert + "down_proj.weight", (H, I), (Target(ours + "experts_down", (e,)),)),
        ]
    return tensors


# --- FP8 block-quantized checkpoints -------------------------------------------------------
# A quantized `X.weight` (e4m3) comes with `X.weight_scale_inv` (fp32, one per 128 × 128 block).
SCALE_SUFFIX = "_scale_inv"
# Modules Qwen's FP8 releases keep unquantized (what our writer leaves in the model dtype):
# embeddings and head, norms, the conv, GDN b / a, the router and the shared-expert gate.
NOT_CONVERTED = ("embed_tokens", "lm_head", "norm", "conv1d", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                 "mlp.gate.", "shared_expert_gate")


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def writer_quantizes(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 checkpoint written here stores this tensor in FP8 (Qwen's convention)."""
    return len(shape) == 2 and name.endswith(".weight") and not any(part in name for part in NOT_CONVERTED)


def quantized_model_tensors(config: ModelConfig, layout: CheckpointLayout) -> list[HfTensor]:
    """`checkpoint_tensors` for a model built for an FP8 checkpoint: the GDN b|a rows go to
    the separate `mixer.in_proj_ba` (see GatedDeltaNet), the rest as for any model."""
    boundary = config.conv_dim + config.gdn_value_dim  # first b row of the fused in_proj
    return [replace(t, targets=tuple(_to_in_proj_ba(target, boundary) for target in t.targets))
            for t in checkpoint_tensors(config, layout)]


def _to_in_proj_ba(target: Target, boundary: int) -> Target:
    if not target.param.endswith("mixer.in_proj") or target.index[0].start < boundary:
        return target
    rows = target.index[0]
    return Target(target.param + "_ba", (slice(rows.start - boundary, rows.stop - boundary),))


def fp8_param_names(tensors: list[HfTensor], is_quantized: Callable[[str], bool]) -> frozenset[str]:
    """Our parameters all of whose checkpoint sources are quantized `.weight` tensors."""
    sources: dict[str, list[str]] = {}
    for t in tensors:
        for target in t.targets:
            sources.setdefault(target.param, []).append(t.name)
    return frozenset(param for param, names in sources.items()
                     if all(n.endswith(".weight") and is_quantized(n) for n in names))
