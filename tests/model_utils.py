"""Test helpers for the model layer, reusable by engine / jobs tests.

- `make_tiny_checkpoint(dir, kind, sharded, seed)`: a tiny checkpoint written by transformers
  itself (the parity reference), with norm weights, A_log and dt_bias perturbed away from
  their init values so that a wrong (1 + w) or gate convention cannot hide.
- `hf_reference(path)`: the transformers model of such a checkpoint (fp32, eval).
- `PackedDriver`: runs a `HybridModel` the way an engine does — packed varlen prefill and
  batched decode over state / KV slots handed out in scrambled order.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from batchinfer.models import ForwardBatch, HybridModel, allocate_caches

KINDS = ("qwen3_5", "qwen3_next", "qwen3_5_vlm", "qwen3_5_moe")

_COMMON = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=96, initializer_range=0.1,
    max_position_embeddings=4096, rms_norm_eps=1e-6,
)
_MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def _build_hf_model(kind: str, seed: int):
    """A randomly initialised transformers causal LM of `kind` (the text part, for the VLM kind)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind in ("qwen3_5", "qwen3_5_vlm"):
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**_COMMON))
    elif kind == "qwen3_next":
        # Layer 1 dense via mlp_only_layers; no top-k renormalisation (the non-default router path).
        config = tf.Qwen3NextConfig(**_COMMON, **_MOE, mlp_only_layers=[1], norm_topk_prob=False)
        model = tf.Qwen3NextForCausalLM(config)
    elif kind == "qwen3_5_moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**_COMMON, **_MOE))
    else:
        raise ValueError(f"unknown kind {kind!r}; kinds: {KINDS}")
    _perturb_(model, seed)
    return model.eval()


@torch.no_grad()
def _perturb_(model: torch.nn.Module, seed: int) -> None:
    """Move every init-constant parameter off its init value (norms 0 / 1, dt_bias 1, ...)."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("linear_attn.norm.weight"):
            param.copy_(1.0 + 0.3 * noise)  # plain-weight gated norm
        elif name.endswith("norm.weight"):
            param.copy_(0.3 * noise)  # (1 + w) norms, zero-initialised by transformers
        elif name.endswith("dt_bias"):
            param.copy_(0.5 * noise)
        elif name.endswith("A_log"):
            param.copy_(torch.empty(param.shape).uniform_(0.2, 3.0, generator=generator).log())


def make_tiny_checkpoint(tmp_dir: str | Path, kind: str = "qwen3_5", sharded: bool = False, seed: int = 0) -> Path:
    """Save a tiny transformers checkpoint of `kind` under tmp_dir; returns its directory.

    kinds: "qwen3_5" (Qwen3_5ForCausalLM, dense), "qwen3_next" (Qwen3NextForCausalLM, MoE with
    one dense layer), "qwen3_5_moe" (Qwen3_5MoeForCausalLM), "qwen3_5_vlm" (the "qwen3_5"
    weights of the same seed saved as Qwen3_5ForConditionalGeneration: model_type qwen3_5,
    text_config, weights under model.language_model.*, plus a tiny vision tower to skip).
    """
    path = Path(tmp_dir) / f"{kind}-seed{seed}{'-sharded' if sharded else ''}"
    model = _build_hf_model(kind, seed)
    if kind == "qwen3_5_vlm":
        model = _as_vlm(model)
    # Tiny shards force an index with several files.
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "1GB")
    return path


def _as_vlm(text_model):
    import transformers as tf

    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                  out_hidden_size=text_model.config.hidden_size)
    config = tf.Qwen3_5Config(text_config=text_model.config.to_dict(), vision_config=vision)
    vlm = tf.Qwen3_5ForConditionalGeneration(config)
    vlm.model.language_model.load_state_dict(text_model.model.state_dict())
    vlm.lm_head.load_state_dict(text_model.lm_head.state_dict())
    return vlm.eval()


def hf_reference(path: str | Path):
    """The transformers causal LM (fp32, eval) of a checkpoint made by `make_tiny_checkpoint`.

    A VLM-layout checkpoint is loaded by transformers into Qwen3_5ForCausalLM from its
    text_config (transformers strips the `language_model` prefix itself).
    """
    import transformers as tf

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    if raw["model_type"] == "qwen3_5":
        config = tf.Qwen3_5TextConfig(**raw["text_config"])
        return tf.Qwen3_5ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Logits [len, vocab] (fp32) of one sequence through transformers."""
    ids = torch.tensor([token_ids])
    return hf_model(input_ids=ids, use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], steps: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                            pad_token_id=0)
    return out[0, len(prompt):].tolist()


@dataclass
class _Sequence:
    state_slot: int
    kv_slots: list[int] = field(default_factory=list)


class PackedDriver:
    """Minimal engine stand-in: packs sequences into `ForwardBatch`es and owns the caches.

    KV slots come from a shuffled free list and state slots are chosen by the caller, so
    nothing lines up with sequence order by accident.
    """

    def __init__(self, model: HybridModel, num_state_slots: int = 8, num_kv_slots: int = 2048,
                 replay_ring_len: Optional[int] = None, ckpt_dtype: Optional[torch.dtype] = None, seed: int = 0):
        self.model = model
        self.device = model.device
        self.caches = allocate_caches(model.config, num_state_slots, num_kv_slots, model.dtype, model.device,
                                      replay_ring_len=replay_ring_len, ckpt_dtype=ckpt_dtype)
        self.free_kv = list(range(num_kv_slots))
        random.Random(seed).shuffle(self.free_kv)
        self.replay = replay_ring_len is not None
        self.seqs: dict[object, _Sequence] = {}

    def add(self, seq_id, state_slot: int) -> None:
        self.seqs[seq_id] = _Sequence(state_slot)

    def prefill(self, new_tokens: dict, all_logits: bool = False) -> dict:
        """Append prompt tokens to several sequences in one packed step.

        Returns per sequence the logits of its last new token [vocab], or of all of them [n, vocab].
        """
        return self._step(new_tokens, is_decode=False, all_logits=all_logits)

    def decode(self, next_tokens: dict) -> dict:
        """One token per sequence (each must already have state). Returns logits [vocab] each."""
        return self._step({sid: [tok] for sid, tok in next_tokens.items()}, is_decode=True, all_logits=False)

    def _step(self, new_tokens: dict, is_decode: bool, all_logits: bool) -> dict:
        ids, positions, out_slots, kv_indices, cu, indptr, logit_rows, spans = [], [], [], [], [0], [0], [], {}
        for sid, tokens in new_tokens.items():
            seq = self.seqs[sid]
            start = len(seq.kv_slots)
            new_slots = [self.free_kv.pop() for _ in tokens]
            seq.kv_slots += new_slots
            first_row = len(ids)
            ids += list(tokens)
            positions += range(start, start + len(tokens))
            out_slots += new_slots
            kv_indices += seq.kv_slots
            cu.append(len(ids))
            indptr.append(len(kv_indices))
            rows = list(range(first_row, len(ids))) if all_logits else [len(ids) - 1]
            spans[sid] = (len(logit_rows), len(logit_rows) + len(rows))
            logit_rows += rows

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=self.device)

        batch = ForwardBatch(
            input_ids=tensor(ids), positions=tensor(positions), cu_seqlens=tensor(cu, torch.int32),
            is_decode=is_decode, state_slots=tensor([self.seqs[s].state_slot for s in new_tokens]),
            out_kv_slots=tensor(out_slots), kv_indices=tensor(kv_indices), kv_indptr=tensor(indptr, torch.int32),
            logits_indices=tensor(logit_rows), replay=self.replay and is_decode,
        )
        logits = self.model(batch, self.caches)
        return {sid: logits[a:b] if all_logits else logits[a] for sid, (a, b) in spans.items()}

    def greedy(self, prompts: dict, steps: int) -> dict:
        """Prefill every prompt in one packed step, then `steps` greedy decode steps for all."""
        last = self.prefill(prompts)
        generated = {sid: [] for sid in prompts}
        for step in range(steps):
            tokens = {sid: int(logit.argmax()) for sid, logit in last.items()}
            for sid, tok in tokens.items():
                generated[sid].append(tok)
            if step + 1 < steps:
                last = self.decode(tokens)
        return generated
