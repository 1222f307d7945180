"""Engine statistics: a mutable tally the engine updates, and the frozen snapshot it hands out."""
from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class EngineStats:
    requests: int = 0                     # (request, sample) pairs finished, errors included
    prompt_tokens: int = 0                # Σ prompt length over finished samples
    cached_tokens: int = 0                # prompt tokens reused from the prefix cache
    theoretical_max_cached_tokens: int = 0  # the planner's ideal for the same samples
    planned_reuse_lost_tokens: int = 0    # Σ over samples of what they reused short of their plan
    branch_states_over_capacity: int = 0  # planned branch states given up: more live at once than the state pool holds
    discarded_kv_tokens: int = 0          # KV matched past the deepest state: recomputed anyway
    recomputed_tokens: int = 0            # prompt + output tokens prefilled again after preemption
    states_tracked: int = 0
    states_donated: int = 0
    states_evicted: int = 0
    tracks_skipped: int = 0               # tracked states not cached: no slot even after eviction
    replayssm_flushes: int = 0            # sequence-steps that folded a full ring into the state snapshot
    output_tokens: int = 0
    preemptions: int = 0
    decode_steps: int = 0                 # decode forwards run
    decode_seq_steps: int = 0             # Σ batch size over decode forwards
    decode_context_tokens: int = 0        # Σ context length (KV read) over decoded sequences
    decode_shared_kv_tokens: int = 0      # of those, KV positions shared with the row before (read once)
    mixed_steps: int = 0                  # forwards over prefill chunks and decode rows together (not in decode_steps)
    mixed_seq_steps: int = 0              # Σ decode rows over those forwards
    concurrent_steps: int = 0             # steps whose prefill forward ran beside their decode forward (in decode_steps)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    mixed_seconds: float = 0.0            # wall time of mixed steps (no device sync: the GPU's with overlap)
    concurrent_seconds: float = 0.0       # wall time of concurrent steps, both forwards (no device sync, as mixed_seconds)
    wall_seconds: float = 0.0
    peak_memory_bytes: int = 0            # CUDA: torch's max_memory_allocated; CPU: peak_rss_bytes
    peak_rss_bytes: int = 0               # the process's peak resident set (its whole life, not one job)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        return self.theoretical_max_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(cache_hit_rate=self.cache_hit_rate, ideal_hit_rate=self.ideal_hit_rate,
                   prompt_tokens_per_second=self.prompt_tokens_per_second,
                   output_tokens_per_second=self.output_tokens_per_second)
        return out


def process_peak_rss_bytes() -> int:
    """The process's peak resident set size so far (getrusage's ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class StatsTally:
    """Counters the engine bumps as it runs; `snapshot()` freezes them (plus cache counters)."""

    def __init__(self) -> None:
        self._values = {f.name: f.default for f in fields(EngineStats)}

    def add(self, **increments: float) -> None:
        for name, value in increments.items():
            self._values[name] += value

    def set_max(self, name: str, value: float) -> None:
        self._values[name] = max(self._values[name], value)

    def get(self, name: str) -> float:
        return self._values[name]

    def snapshot(self, **overrides: float) -> EngineStats:
        return replace(EngineStats(**self._values), **overrides)
