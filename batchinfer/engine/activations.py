"""What one engine step needs besides the pools: the transient tensors of the largest eager step
and what the decode graphs hold (the engine reserves it before sizing the pools from the rest)."""
from __future__ import annotations

import torch

from batchinfer.kernels.public import PREFILL_CHUNK


def _bytes_per_step_token(config, item: int) -> int:
    """Transient bytes per token of a step: the residual stream (3 hidden rows) plus the largest
    layer's live tensors — GDN: its in-projection, conv output and the chunked prefill's per-token
    scratch (new values, q·S0 rows, outputs, G, key norms: kernels/gdn_prefill/work.py); attention:
    q|gate, k, v and the output; MLP: gate|up and the activation (MoE: each token's k sorted
    copies through their experts, the shared expert, the router's probabilities and the fp32 sum)."""
    h_k, h_v = config.linear_num_key_heads, config.linear_num_value_heads
    gdn = (2 * config.conv_dim + 6 * h_v * config.linear_value_head_dim) * item + (h_v + h_k) * 4
    attn = (4 * config.num_attention_heads * config.head_dim + 2 * config.num_kv_heads * config.head_dim) * item
    mlp = 3 * config.intermediate_size * item
    if config.num_experts:  # batchinfer/models/layers/mlp.py: inputs sorted by expert, fp32 output
        k, hidden = config.num_experts_per_tok, config.hidden_size
        moe = (k * (2 * hidden + 3 * config.moe_intermediate_size) + 3 * config.shared_expert_intermediate_size) * item
        mlp = max(mlp, moe + 4 * hidden + 8 * config.num_experts + 24 * k)
    return 3 * config.hidden_size * item + max(gdn, attn, mlp)


def step_activation_bytes(config, dtype: torch.dtype, max_batch_tokens: int, max_running: int) -> int:
    """An upper estimate of the transient memory of the largest eager step. `config` is a
    `batchinfer.models.config.ModelConfig`.

    Per token of the step (max_batch_tokens: prefill tokens, a mixed step's decode rows among
    them; or max_running decode rows):
    `_bytes_per_step_token`. Per step: the prefill's per-chunk scratch ((T/64 + B) chunks, each
    H_v·64·64: M⁻¹·diag(beta)) and fp32 logits for every running request twice (the logits and
    one sampling temporary).
    """
    item = dtype.itemsize
    tokens = max(max_batch_tokens, max_running)
    per_chunk = (tokens // PREFILL_CHUNK + max_running) * config.linear_num_value_heads * PREFILL_CHUNK ** 2 * item
    logits = 2 * max_running * config.vocab_size * 4
    return tokens * _bytes_per_step_token(config, item) + per_chunk + logits


def decode_graph_bytes(config, dtype: torch.dtype, bucket_sizes: list[int], ctx_cap: int) -> int:
    """What CUDA graphs of decode steps hold for the engine's life, apart from the eager steps'
    memory (batchinfer/engine/cuda_graphs.py): the fp32 logits buffer all buckets share
    [max b, V], the context-slot buffer [max b · ctx_cap] int64, and the largest capture's other
    tensors (the smaller captures reuse them)."""
    item = dtype.itemsize
    largest = max(bucket_sizes)
    return (largest * config.vocab_size * 4 + largest * ctx_cap * 8
            + largest * _bytes_per_step_token(config, item))
