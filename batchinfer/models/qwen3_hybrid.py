"""The GDN-hybrid decoder (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next) over packed varlen batches.

`HybridModel.forward(batch, caches)` runs one engine step: the new tokens of B sequences
packed into T rows, every GDN and attention state passed in through `ModelCaches` and
updated in place. A mixed step's batch (prefill chunks, then decode rows) runs every
token-wise op once over all T rows and each mixer's prefill and decode kernels on their parts. Each layer is pre-norm: x + mixer(norm(x)), then x + mlp(norm(x)), with
the family's (1 + weight) RMSNorm. Every residual add is fused with the norm that reads its
result (`ops.add_rms_norm`): the mixer's with the layer's post-mixer norm, the MLP's with the
next layer's input norm, so a layer hands its MLP output on un-added, and the last one's is
added by the final norm. Parameters are allocated empty on the target device;
`loader.load_weights` or a preset's random init fills them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.models.config import LINEAR_ATTENTION, ModelConfig
from batchinfer.models.forward_batch import ForwardBatch, ModelCaches
from batchinfer.models.layers.attention import GatedAttention
from batchinfer.models.layers.gdn import GatedDeltaNet
from batchinfer.models.layers.mlp import DenseMLP, SparseMoE
from batchinfer.models.layers.params import empty_param
from batchinfer.models.layers.rotary import RotaryEmbedding
from batchinfer.kernels import ops


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str,
                 fp8_params: frozenset[str] | None = None):
        super().__init__()
        quantized = fp8_params is not None
        mixer_fp8, mlp_fp8 = (_local(fp8_params or frozenset(), f"layers.{layer_id}.{part}.") for part in ("mixer", "mlp"))
        self.eps = config.rms_norm_eps
        self.is_gdn = config.layer_types[layer_id] == LINEAR_ATTENTION
        self.input_norm = empty_param(config.hidden_size, dtype=dtype, device=device)
        self.post_norm = empty_param(config.hidden_size, dtype=dtype, device=device)
        if self.is_gdn:
            self.mixer = GatedDeltaNet(config, config.gdn_layer_ids.index(layer_id), dtype, device,
                                       mixer_fp8 if quantized else None)
        else:
            self.mixer = GatedAttention(config, config.attn_layer_ids.index(layer_id), dtype, device, mixer_fp8)
        if config.is_moe_layer(layer_id):
            self.mlp = SparseMoE(config, dtype, device, mlp_fp8)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, dtype, device, mlp_fp8)

    def forward(self, x: torch.Tensor, pending_mlp_out: torch.Tensor | None, batch: ForwardBatch,
                caches: ModelCaches, rotary: RotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream x [T, hidden] plus the previous layer's MLP output not yet added to
        it (None for the first layer) -> (x, this layer's MLP output, likewise not yet added)."""
        if pending_mlp_out is None:
            h = ops.rms_norm(x, self.input_norm, self.eps)  # [T, hidden]
        else:
            x, h = ops.add_rms_norm(x, pending_mlp_out, self.input_norm, self.eps)
        if self.is_gdn:
            mixer_out = self.mixer(h, batch, caches)  # [T, hidden]
        else:
            mixer_out = self.mixer(h, batch, caches, rotary, cos, sin)
        x, h = ops.add_rms_norm(x, mixer_out, self.post_norm, self.eps)
        return x, self.mlp(h)  # [T, hidden] each


def _local(names: frozenset[str], prefix: str) -> frozenset[str]:
    return frozenset(n.removeprefix(prefix) for n in names if n.startswith(prefix))


class HybridModel(nn.Module):
    """`fp8_params`: None for an unquantized model; for an FP8 checkpoint's model the names of
    the projections (ours, e.g. `layers.3.mixer.qkv_proj`) stored as FP8 with block scales —
    the GDN b|a rows are then `mixer.in_proj_ba`, apart from in_proj (q|k|v|z)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", fp8_params: frozenset[str] | None = None):
        super().__init__()
        self.config = config
        self.fp8_params = fp8_params
        self.dtype = dtype
        self.device = torch.device(device)
        self.embed = empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device, fp8_params) for i in range(config.num_layers))
        self.final_norm = empty_param(config.hidden_size, dtype=dtype, device=device)
        # Tied checkpoints reuse the embedding matrix; it is then not a separate parameter.
        self.lm_head = None if config.tie_word_embeddings else empty_param(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, device)

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head  # [vocab, hidden]

    # no_grad, not inference_mode: inference tensors would forbid callers' in-place edits of
    # the logits (e.g. a sampler's repetition penalty).
    @torch.no_grad()
    def forward(self, batch: ForwardBatch, caches: ModelCaches, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab] fp32 for the tokens at `batch.logits_indices`; written into
        `logits_out` [N, vocab] fp32 when given (the decode graphs' one shared buffer)."""
        prefill, decode = batch.prefill_part, batch.decode_part  # a mixed step has both
        if caches.has_replay and prefill is not None:
            fold_pending_ring_entries(prefill.state_slots, caches)
        x = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions)  # [T, rot/2] each
        mlp_out = None
        for layer in self.layers:
            x, mlp_out = layer(x, mlp_out, batch, caches, self.rotary, cos, sin)
        if decode is not None and decode.replay:
            advance_ring_cursors(decode.state_slots, caches)
        # The last residual add is needed only where logits are read: gather those rows first.
        rows = batch.logits_indices
        _, x = ops.add_rms_norm(x[rows], mlp_out[rows], self.final_norm, self.config.rms_norm_eps)  # [N, hidden]
        return fp32_logits(x, self.output_embedding, logits_out)  # [N, vocab]


def fp32_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits [N, vocab] of the final hidden rows x [N, hidden] through `weight` [vocab, hidden].

    On CUDA with 16-bit weights the GEMM writes fp32 itself (fp32 accumulators stored
    as they are): no 16-bit logits tensor and no widening copy of it — at batch 256 and a
    248k vocabulary that copy moved ~380 MB per decode step — and no rounding of the
    logits to 16 bits. Elsewhere (the CPU's fp32 parity path) a plain linear.
    """
    if x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):
        if out is None:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)
    logits = F.linear(x, weight).float()
    return logits if out is None else out.copy_(logits)


def advance_ring_cursors(slots: torch.Tensor, caches: ModelCaches) -> None:
    """After a ReplaySSM decode step: every GDN layer of `caches` appended one ring entry at index
    cursor % L (a full ring was folded first), so the shared cursor advances once, after all layers."""
    caches.cursor[slots] = caches.cursor[slots] % caches.ring_len + 1


def fold_pending_ring_entries(slots: torch.Tensor, caches: ModelCaches) -> None:
    """Prefill continues from the ReplaySSM state snapshot, so pending ring entries must be in it
    (over every GDN layer `caches` holds: the model's, or one pipeline stage's).

    The cache contract already hands prefill only folded states (cursor 0); this keeps a
    slot that decoded through ReplaySSM and then receives more prompt tokens (e.g. a chat
    turn) exact instead of silently dropping its last tokens. One sync per prefill step.
    """
    pending = slots[caches.cursor[slots] != 0]
    if pending.numel() == 0:
        return
    for j in range(len(caches.ssm)):
        ops.replay_fold(caches.ssm[j], caches.ring_k[j], caches.ring_u[j], caches.ring_g[j], caches.cursor,
                        pending, pending)
    caches.cursor[pending] = 0
