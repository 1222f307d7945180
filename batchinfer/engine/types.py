"""Requests in, results out: the engine's public value types.

`jobs/` builds `Request`s from rows and consumes `RequestOutput`s; nothing here touches
tensors, so these types are cheap to create for millions of rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Literal, Optional


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0          # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 → off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0                     # with the request's `seed_key` and sample index → one RNG stream
    stop: tuple[str, ...] = ()        # stop strings (need a detokenizer on the engine)
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    # Per generated token: the chosen token's logprob and the `logprobs` most likely tokens'
    # (0: the chosen one's only; None: off), from the model's raw distribution (see TokenLogprob).
    logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):  # NaN would pass every range check below
                raise ValueError(f"{name} must be a finite number")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        if not 0 <= self.seed < 1 << 64:  # the sampler hashes it as two 32-bit words: no aliasing
            raise ValueError("seed must be in [0, 2**64)")
        if self.n < 1:
            raise ValueError("n must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.min_tokens < 0:
            raise ValueError("top_k and min_tokens must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")


@dataclass(frozen=True)
class Request:
    request_id: Hashable               # echoed back in every output
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed_key: int = 0                  # e.g. the row index: same seed_key + seed + sample → same tokens
    skip_samples: tuple[int, ...] = () # sample indices already done (resume): not generated
    # > 0: a scoring request. The last `score_tokens` prompt tokens are a continuation to score
    # (RequestOutput.score); nothing is generated and `sampling` is not used.
    score_tokens: int = 0
    # An output constraint (structured output): an object whose `matcher()` starts one sample's
    # matcher, with `fill_mask(row)` (int32 bitmask [ceil(V / 32)] of the allowed next tokens),
    # `accept(token) -> bool`, and `fill_masks(matchers, bitmask [B, W])` for a batch
    # (jobs.structured.CompiledGrammar). Sampling draws among the allowed tokens only.
    grammar: Optional[Any] = field(default=None, compare=False)

    @property
    def scored_prompt(self) -> tuple[int, ...]:
        """The prompt without the continuation scored: what such requests share (the prefix plan's key)."""
        return self.prompt_token_ids[:len(self.prompt_token_ids) - self.score_tokens]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model's raw distribution: fp32
    log_softmax of its logits before repetition penalty, banned tokens, temperature and
    top-k / top-p / min-p (what the model says, not what the sampler drew from)."""
    logprob: float                      # of the token generated
    top_ids: tuple[int, ...] = ()       # the k most likely tokens, most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class ContinuationScore:
    """A scoring request's continuation under the model's raw distribution (fp32 log_softmax)."""
    logprob: float                      # summed over its tokens
    tokens: int                         # how many
    greedy: bool                        # every token is the argmax given the ones before


FinishReason = Literal["stop", "length", "error"]


@dataclass(frozen=True)
class RequestOutput:
    request_id: Hashable
    sample_index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int                 # prompt tokens reused from the prefix cache
    completion_tokens: int
    error: Optional[str] = None        # set with finish_reason == "error" (e.g. prompt too long)
    theoretical_max_cached_tokens: int = 0  # the planner's ideal reuse for this sample
    unit_index: int = 0                # which unit (or plan window) of the generate call this sample belongs to
    unit_done: bool = False            # the last output of its unit: every sample of the unit is out
    logprobs: Optional[tuple[TokenLogprob, ...]] = None  # one per token of token_ids when sampling.logprobs is set
    score: Optional[ContinuationScore] = None  # a scoring request's (Request.score_tokens > 0)
