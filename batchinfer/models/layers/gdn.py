"""Gated DeltaNet mixer: the linear-attention layer of the hybrid.

One fused input projection yields q|k|v (the conv channels), the output gate z, and the
per-value-head b (write strength) and a (decay); the causal conv with SiLU runs over q|k|v,
then the gated delta rule (prefill: chunked; decode: recurrent or ReplaySSM), a gated
RMSNorm with silu(z), and the output projection. All state lives in `ModelCaches`, indexed
by this layer's `cache_index` and by the batch's state slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.models.config import ModelConfig
from batchinfer.models.forward_batch import ForwardBatch, ModelCaches
from batchinfer.models.layers.fp8_linear import block_aligned, linear, projection
from batchinfer.models.layers.params import empty_param
from batchinfer.kernels import ops


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, cache_index: int, dtype: torch.dtype, device: torch.device | str,
                 fp8: frozenset[str] | None = None):
        super().__init__()
        self.cache_index = cache_index  # which conv / ssm / ring tensors of ModelCaches are ours
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.k_head_dim = config.linear_key_head_dim
        self.v_head_dim = config.linear_value_head_dim
        self.eps = config.rms_norm_eps
        self.conv_dim = config.conv_dim
        value_dim = config.gdn_value_dim
        # Rows: q | k | v (the conv channels), z, b, a.
        self.split_sizes = [self.conv_dim, value_dim, self.num_v_heads, self.num_v_heads]
        # fp8 (a quantized checkpoint; the names of this module's FP8 projections): b|a, which
        # checkpoints keep unquantized and whose 2·H_v rows are no whole block, is then a
        # projection of its own, `in_proj_ba`, and in_proj holds q|k|v|z.
        self.in_proj_ba = None
        if fp8 is None:
            self.in_proj = empty_param(sum(self.split_sizes), config.hidden_size, dtype=dtype, device=device)
        else:
            K_dim, ratio = config.gdn_key_dim, self.num_v_heads // self.num_k_heads
            aligned = block_aligned(K_dim, K_dim, value_dim, value_dim) and (
                not config.fused_gdn_projections  # Qwen3-Next's per-key-head groups must be block aligned too
                or block_aligned(self.k_head_dim, self.k_head_dim, ratio * self.v_head_dim, ratio * self.v_head_dim, 0))
            self.in_proj = projection(self.conv_dim + value_dim, config.hidden_size, dtype=dtype, device=device,
                                      fp8="in_proj" in fp8 and aligned)
            self.in_proj_ba = empty_param(2 * self.num_v_heads, config.hidden_size, dtype=dtype, device=device)
        self.conv_weight = empty_param(self.conv_dim, config.linear_conv_kernel_dim, dtype=dtype, device=device)
        # The decay parameters stay fp32: exp(A_log) is sensitive and they are tiny.
        self.A_log = empty_param(self.num_v_heads, dtype=torch.float32, device=device)
        self.dt_bias = empty_param(self.num_v_heads, dtype=torch.float32, device=device)
        self.norm_weight = empty_param(self.v_head_dim, dtype=dtype, device=device)  # plain weight, not 1+w
        self.out_proj = projection(config.hidden_size, value_dim, dtype=dtype, device=device,
                                   fp8=fp8 is not None and "out_proj" in fp8)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        T, H_v, d_v = x.shape[0], self.num_v_heads, self.v_head_dim
        # Views, not copies: every kernel (and reference) takes row strides, so the split and
        # the head reshapes below cost nothing.
        if self.in_proj_ba is None:
            mixed_qkv, z, b, a = F.linear(x, self.in_proj).split(self.split_sizes, dim=-1)  # [T, D_conv] view
        else:
            mixed_qkv, z = linear(x, self.in_proj).split(self.split_sizes[:2], dim=-1)
            b, a = F.linear(x, self.in_proj_ba).split(self.split_sizes[2:], dim=-1)  # [T, H_v] views
        # Token-wise above and below; the conv and the delta rule per part of a mixed step.
        parts = [self._mix(mixed_qkv[rows], a[rows], b[rows], part, caches) for rows, part in batch.segments()]
        o = parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, H_v, d_v]
        o = ops.gated_rms_norm(o, z.reshape(T, H_v, d_v), self.norm_weight, self.eps)  # [T, H_v, d_v]
        return linear(o.reshape(T, H_v * d_v), self.out_proj)  # [T, hidden]

    def _mix(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: ForwardBatch,
             caches: ModelCaches) -> torch.Tensor:
        """The conv and the gated delta rule over one part's rows (`batch`: prefill or decode;
        a mixed step's part): mixed_qkv [t, D_conv], a and b [t, H_v] (views) -> o [t, H_v, d_v]."""
        t = mixed_qkv.shape[0]
        H_k, H_v, d_k, d_v = self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim
        j = self.cache_index
        slots = batch.state_slots
        if batch.is_decode:
            mixed_qkv = ops.causal_conv1d_decode(mixed_qkv, self.conv_weight, None, caches.conv[j], slots)
        else:
            mixed_qkv = ops.causal_conv1d_prefill(mixed_qkv, self.conv_weight, None, caches.conv[j], slots,
                                                  batch.cu_seqlens, chunk_tables=batch.chunk_tables)
        q, k, v = mixed_qkv.split([H_k * d_k, H_k * d_k, H_v * d_v], dim=-1)
        q = q.reshape(t, H_k, d_k)
        k = k.reshape(t, H_k, d_k)
        v = v.reshape(t, H_v, d_v)  # a, b: [t, H_v] views
        gdn_args = (q, k, v, a, b, self.A_log, self.dt_bias)
        if batch.is_decode and batch.replay:
            return ops.replay_decode(*gdn_args, caches.ssm[j], caches.ring_k[j], caches.ring_u[j], caches.ring_g[j],
                                     caches.cursor, slots)
        if batch.is_decode:
            return ops.gdn_decode(*gdn_args, caches.ssm[j], slots)
        return ops.gdn_prefill(*gdn_args, caches.ssm[j], slots, batch.cu_seqlens,
                               chunk_tables=batch.chunk_tables)  # [t, H_v, d_v]
