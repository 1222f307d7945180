"""Gated full attention: GQA with per-head q/k RMSNorm, partial RoPE and a sigmoid output gate.

The q projection yields, per head, `d` query channels followed by `d` gate channels (the
checkpoint's own interleave); the attention output is multiplied elementwise by
sigmoid(gate) before the output projection. q, k and v are one fused projection here.
"""
from __future__ import annotations

import torch
from torch import nn

from batchinfer.models.config import ModelConfig
from batchinfer.models.forward_batch import ForwardBatch, ModelCaches
from batchinfer.models.layers.fp8_linear import block_aligned, linear, projection
from batchinfer.models.layers.params import empty_param
from batchinfer.models.layers.rotary import RotaryEmbedding
from batchinfer.kernels import ops


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, cache_index: int, dtype: torch.dtype, device: torch.device | str,
                 fp8: frozenset[str] = frozenset()):
        super().__init__()
        self.cache_index = cache_index  # which kv_k / kv_v pool of ModelCaches this layer owns
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = d = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = d ** -0.5
        # Rows: [q_h | gate_h] per head h (2·H·d), then k (H_kv·d), then v (H_kv·d).
        qkv_rows = 2 * self.num_heads * d + 2 * self.num_kv_heads * d
        # fp8: the names of this module's projections stored FP8 (the checkpoint has their scales).
        qkv_fp8 = "qkv_proj" in fp8 and block_aligned(2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = projection(qkv_rows, config.hidden_size, dtype=dtype, device=device, fp8=qkv_fp8)
        self.q_norm = empty_param(d, dtype=dtype, device=device)
        self.k_norm = empty_param(d, dtype=dtype, device=device)
        self.o_proj = projection(config.hidden_size, self.num_heads * d, dtype=dtype, device=device, fp8="o_proj" in fp8)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches,
                rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T, H, H_kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_proj)  # [T, 2Hd + 2H_kv·d]
        q_and_gate, k, v = qkv.split([2 * H * d, H_kv * d, H_kv * d], dim=-1)
        q, gate = q_and_gate.view(T, H, 2 * d).split([d, d], dim=-1)  # [T, H, d] each
        rot = rotary.rotary_dim
        q = ops.rms_norm_rope(q, self.q_norm, cos, sin, self.eps, rot)  # [T, H, d]
        k = ops.rms_norm_rope(k.view(T, H_kv, d), self.k_norm, cos, sin, self.eps, rot)  # [T, H_kv, d]
        v = v.reshape(T, H_kv, d).contiguous()  # kernels may assume dense rows

        k_cache, v_cache = caches.kv_k[self.cache_index], caches.kv_v[self.cache_index]
        ops.store_kv(k, v, k_cache, v_cache, batch.out_kv_slots)
        # Token-wise above and below; attention itself per part of a mixed step.
        parts = [self._attend(q[rows], k_cache, v_cache, part) for rows, part in batch.segments()]
        o = parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, H, d]
        o = o * torch.sigmoid(gate)  # the gate is per head and channel
        return linear(o.reshape(T, H * d), self.o_proj)  # [T, hidden]

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Attention of one part's queries q [t, H, d] over their contexts (`batch`: prefill or
        decode; a mixed step's part), their own keys already stored -> o [t, H, d]."""
        if batch.is_decode:
            # Rows that share a prefix's KV (batch.shared_with_prev) read it once between them.
            return ops.attention_decode(q, k_cache, v_cache, batch.kv_indices, batch.kv_indptr, self.scale,
                                        shared_with_prev=batch.shared_with_prev)
        return ops.attention_prefill(q, k_cache, v_cache, batch.kv_indices, batch.kv_indptr,
                                     batch.cu_seqlens, self.scale)
