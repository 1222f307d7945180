"""Engine settings: one frozen dataclass, validated on creation, resolved against the host."""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Optional, get_args

import torch

from batchinfer.cache.budget import size_max_running
from batchinfer.cache.cache_config import StateCacheMode

log = logging.getLogger(__name__)
MIXED_STEP_ENV = "BATCHINFER_MIXED_STEP"  # "1" / "0": the mixed step on / off, whatever the config
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}

KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}  # None: the model dtype


DEFAULT_MAX_RUNNING = 256
# MoE: a decode step reads every routed expert's weights for a few rows each, so more rows amortise them
# (the peer runs Qwen3.5-35B-A3B at 1,024 concurrent); the memory budget caps it where it fits fewer.
DEFAULT_MAX_RUNNING_MOE = 1024
# Every prefill step runs a decode forward beside it (and a MoE's reads all its routed experts), so
# larger steps amortise both: 8k in / 1k out on the H200 at 32,768 against 8,192 tokens a step,
# 27B bf16 and FP8 1.03x, 35B-A3B bf16 1.16x, FP8 1.17x the total tok/s (docs/BENCHMARKS.md)
DEFAULT_MAX_BATCH_TOKENS = 32768
# The step the default gives way to where its activations would crowd the pools (build.larger_step_fits)
FALLBACK_MAX_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"                 # "auto" → cuda when available, else cpu
    dtype: str = "auto"                  # "auto" → bf16 on CUDA, fp32 on CPU
    prefix_cache: bool = True            # False: every prompt is prefilled from scratch
    state_cache: StateCacheMode = "extra_buffer"
    replayssm: bool = True               # decode GDN layers through checkpoint + ring
    ring_len: int = 16                   # ReplaySSM ring length L
    ckpt_dtype: Optional[str] = None     # ReplaySSM checkpoint dtype; None → the model dtype
    # KV pool dtype: "auto" → the model dtype; "fp8_e4m3" halves a decode step's KV bytes (stored
    # without a scale, saturated at ±448; attention widens it to the model dtype tile by tile)
    kv_cache_dtype: str = "auto"
    track_interval: int = 8192           # also checkpoint every this many prompt tokens (unplanned reuse);
                                         # each multiple ends a prefill chunk, so small values cut long prompts short
    # sequences decoding at once; None: DEFAULT_MAX_RUNNING (DEFAULT_MAX_RUNNING_MOE for a MoE model),
    # or fewer where the memory budget fits fewer (warned only for a value the job set)
    max_running: Optional[int] = None
    # KV positions a running row is expected to hold (its prompt tokens not shared with other rows +
    # max_tokens; the job's plan knows them): with max_running unset, the rows are sized so that
    # that many fit the KV pool (cache.budget.size_max_running), capped by the default above
    row_tokens: Optional[int] = None
    # tokens per step: prefill tokens, plus the decode rows with mixed_step; None: DEFAULT_MAX_BATCH_TOKENS,
    # or FALLBACK_MAX_BATCH_TOKENS on a GPU where its activations would crowd the pools
    max_batch_tokens: Optional[int] = None
    max_model_len: Optional[int] = None  # None → the model's max_position_embeddings
    memory_fraction: float = 0.9         # share of the free device memory for the pools (at most free − a step's activations)
    memory_budget_bytes: Optional[int] = None  # explicit pool budget (tests force eviction with it)
    plan_window: Optional[int] = None    # rows planned together; None → the whole input
    cuda_graphs: bool = True             # capture decode steps (CUDA only)
    overlap_decode: bool = True          # launch the next decode step before reading this one's tokens
    # One forward per step over the prefill chunks and the decode rows (False: a prefill forward,
    # then a decode forward). Off by default: on the H200 it is level with the two forwards once its
    # shapes are compiled, and compiles them mid-run (docs/BENCHMARKS.md, "One forward per step");
    # BATCHINFER_MIXED_STEP=1 / 0 overrides.
    mixed_step: bool = False
    # The prefill forward on a second CUDA stream beside the step's decode forward (engine/side_stream.py):
    # the compute-bound prefill and the memory-bound decode share the GPU instead of taking turns. Off
    # by default until measured on the GPU; not with mixed_step (one forward) or pipeline stages.
    concurrent_prefill: bool = False
    # Layers split over this many stages (models/pipeline.py): on CUDA stage s on cuda:s (or all on
    # a pinned cuda:K), on the CPU all in one process; 1: the whole model as one.
    pipeline_stages: int = 1

    def __post_init__(self) -> None:
        if self.concurrent_prefill and (self.mixed_step or self.pipeline_stages > 1):
            raise ValueError("concurrent_prefill runs the prefill and decode forwards side by side; it does not "
                             "combine with mixed_step (one forward) or pipeline_stages > 1")
        if self.state_cache not in get_args(StateCacheMode):
            raise ValueError(f"state_cache must be 'extra_buffer' or 'no_buffer', not {self.state_cache!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, not {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.ckpt_dtype is not None and self.ckpt_dtype not in _DTYPES:
            raise ValueError(f"ckpt_dtype must be one of {sorted(_DTYPES)}, not {self.ckpt_dtype!r}")
        for name in ("ring_len", "track_interval", "max_running", "max_batch_tokens", "row_tokens", "pipeline_stages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError("memory_fraction must be in (0, 1]")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError("memory_budget_bytes must be > 0")
        if self.plan_window is not None and self.plan_window < 1:
            raise ValueError("plan_window must be >= 1")

    def resolved_max_running(self, model_config=None, pools: Optional[tuple[int, int, int]] = None) -> int:
        """The rows asked for: the config's, else the default for the model (`model_config`, a
        `batchinfer.models.config.ModelConfig`; None: a dense model's), lowered to what the KV pool
        holds at `row_tokens` a row when both that and `pools` = (budget bytes, KV bytes a token,
        state bytes a slot) are given."""
        if self.max_running is not None:
            return self.max_running
        cap = DEFAULT_MAX_RUNNING_MOE if _is_moe(model_config) else DEFAULT_MAX_RUNNING
        if self.row_tokens is None or pools is None:
            return cap
        budget, kv_token, state_slot = pools
        rows = size_max_running(budget, kv_token, state_slot, self.row_tokens, cap)
        log.info("max_running %d for rows of ~%d KV positions (cap %d; %.1f GiB of pools, %d B a KV position, "
                 "%.0f MiB a state slot)", rows, self.row_tokens, cap, budget / 2**30, kv_token, state_slot / 2**20)
        return rows

    def resolved_max_batch_tokens(self) -> int:
        """Tokens per step asked for: the config's, else DEFAULT_MAX_BATCH_TOKENS (the engine may
        step a default down: `build.default_step_tokens`)."""
        return DEFAULT_MAX_BATCH_TOKENS if self.max_batch_tokens is None else self.max_batch_tokens

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def resolved_ckpt_dtype(self) -> torch.dtype:
        """bf16 checkpoints when the model runs in bf16 (the ReplaySSM saving), fp32 otherwise."""
        if self.ckpt_dtype is not None:
            return _DTYPES[self.ckpt_dtype]
        return torch.bfloat16 if self.resolved_dtype() == torch.bfloat16 else torch.float32

    def resolved_kv_dtype(self) -> torch.dtype:
        """The KV pool's dtype: the model's, or FP8 (e4m3) when asked."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.resolved_dtype()

    def resolved_mixed_step(self) -> bool:
        switch = os.environ.get(MIXED_STEP_ENV, "").strip()
        return self.mixed_step if switch not in ("0", "1") else switch == "1"

    def to_dict(self) -> dict:
        return asdict(self)


def _is_moe(model_config) -> bool:
    """A `batchinfer.models.config.ModelConfig` with routed experts (None: no model, a dense default)."""
    return model_config is not None and getattr(model_config, "num_experts", 0) > 0


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
