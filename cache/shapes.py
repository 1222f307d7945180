"""Per-layer tensor shapes of the two pools, and their memory cost.

The pools and the budget need only a handful of numbers from the model; keeping them in two
small frozen dataclasses lets tests build pools at toy shapes without a `ModelConfig`, and
lets `budget.py` price a slot before anything is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVShape:
    """One KV slot (one token) across every full-attention layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)


@dataclass(frozen=True)
class GdnStateShape:
    """One GDN state slot across every GDN layer.

    `ring_len == 0` means plain recurrent decode (`ssm` is the fp32 state S); `ring_len > 0`
    means ReplaySSM (`ssm` is the state snapshot C, plus rings of that length and a cursor).
    """

    num_layers: int
    conv_dim: int          # D_conv = 2·H_k·d_k + H_v·d_v
    conv_kernel: int       # K (the conv state keeps K-1 inputs)
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: torch.dtype  # the model dtype
    ssm_dtype: torch.dtype   # fp32 recurrent state, or the ReplaySSM state snapshot dtype
    ring_len: int = 0

    def __post_init__(self) -> None:
        if self.ring_len < 0:
            raise ValueError("ring_len must be >= 0")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError("num_v_heads must be a multiple of num_k_heads")

    @property
    def replay(self) -> bool:
        return self.ring_len > 0

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * _itemsize(self.conv_dtype)
        ssm = self.num_v_heads * self.head_k_dim * self.head_v_dim * _itemsize(self.ssm_dtype)
        ring = 0
        if self.replay:
            ring = self.ring_len * (self.num_k_heads * self.head_k_dim * _itemsize(self.ssm_dtype)
                                    + self.num_v_heads * self.head_v_dim * _itemsize(self.ssm_dtype)
                                    + self.num_v_heads * 4)  # ring_g is fp32
        cursor = 4 if self.replay else 0  # one int32 per slot, shared by all layers
        return self.num_layers * (conv + ssm + ring) + cursor


def shapes_from_model_config(config, dtype: torch.dtype, *, ring_len: int = 0,
                             ckpt_dtype: torch.dtype | None = None,
                             kv_dtype: torch.dtype | None = None) -> tuple[KVShape, GdnStateShape]:
    """(KVShape, GdnStateShape) of a `batchinfer.models.config.ModelConfig`.

    `ring_len > 0` selects ReplaySSM with state snapshots in `ckpt_dtype` (default fp32; named
    after the job key); without it the recurrent state is fp32 whatever the model dtype (it accumulates over the whole sequence).
    The KV pool is in `kv_dtype` (default: the model dtype `dtype`).
    """
    kv = KVShape(num_layers=len(config.attn_layer_ids), num_kv_heads=config.num_kv_heads,
                 head_dim=config.head_dim, dtype=kv_dtype or dtype)
    gdn = GdnStateShape(
        num_layers=len(config.gdn_layer_ids), conv_dim=config.conv_dim,
        conv_kernel=config.linear_conv_kernel_dim, num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads, head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim, conv_dtype=dtype,
        ssm_dtype=(ckpt_dtype or torch.float32) if ring_len else torch.float32, ring_len=ring_len)
    return kv, gdn
