"""Which backend takes the long new-token runs of a prefill batch, and how a batch splits into calls.

- `triton`: none, the Triton kernel does everything.
- `varlen`: when the batch's longest new run reaches `min_run`, the whole batch is one packed
  `varlen_attn` call over K/V gathered from the pool (flash's causal mask is bottom-right
  aligned, so a cached prefix needs nothing extra; GQA is native).
- `triton-fa`: the same batches to benchmarks/attention_arms/prefill_fa.py (FA2-style, autotuned,
  reads the pool through the slot table: no gather).
- `sdpa-<cudnn|flash|efficient>`: each sequence whose run reaches `min_run` is one SDPA call, the
  short sequences between them one Triton call each (the model's plan, kernels/attention/prefill.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from batchinfer.kernels.attention import prefill
from batchinfer.kernels.attention.prefill import Segment

PACKED_BACKENDS = ("varlen", "triton-fa")
SDPA_BACKENDS = {"sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-flash": "FLASH_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}
BACKENDS = ("triton",) + PACKED_BACKENDS + tuple(SDPA_BACKENDS)
PREFIX_MASKS = ("lower_right", "dense", "split")


@dataclass(frozen=True)
class PrefillPolicy:
    """Which backend takes the long new-token runs of a prefill batch.

    backend: one of BACKENDS. min_run: a run of at least this many new tokens is long.
    repeat_kv: expand KV heads to the query heads before SDPA (for a backend refusing
    enable_gqa). prefix_mask: how SDPA masks a run after a cached prefix, "lower_right"
    (CausalBias), "dense" (a bool [n, ctx] mask) or "split" (prefix and own keys as two calls
    merged by log-sum-exp; sdpa-cudnn only)."""

    backend: str = "triton"
    min_run: int = 1024
    repeat_kv: bool = False
    prefix_mask: str = "lower_right"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"prefill attention backend {self.backend!r}; one of {', '.join(BACKENDS)}")
        if self.prefix_mask not in PREFIX_MASKS:
            raise ValueError(f"prefix_mask {self.prefix_mask!r}; one of {', '.join(PREFIX_MASKS)}")
        if self.prefix_mask == "split" and self.backend != "sdpa-cudnn":
            raise ValueError("prefix_mask 'split' needs the sdpa-cudnn backend (the one whose log-sum-exp it reads)")


# What the model runs (kernels/attention/prefill.py), as a policy.
DEFAULT_POLICY = PrefillPolicy("sdpa-cudnn", min_run=prefill.MIN_RUN, prefix_mask="split")


def plan_segments(new_lens: list[int], policy: PrefillPolicy) -> list[Segment]:
    """Split a batch (new-token run lengths, in batch order) into the calls that run it."""
    B = len(new_lens)
    if B == 0:
        return []
    if policy.backend == "triton" or max(new_lens) < policy.min_run:
        return [Segment("triton", 0, B)]
    if policy.backend in PACKED_BACKENDS:
        return [Segment("backend", 0, B)]
    return prefill.plan_segments(new_lens, policy.min_run)
