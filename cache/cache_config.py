"""The state cache's settings (`CacheConfig`) and its counters (`CacheStats`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

StateCacheMode = Literal["extra_buffer", "no_buffer"]


@dataclass(frozen=True)
class CacheConfig:
    mode: StateCacheMode = "extra_buffer"
    prefix_cache: bool = True  # False: never match, never insert (every prompt from scratch)

    def __post_init__(self) -> None:
        if self.mode not in get_args(StateCacheMode):
            raise ValueError(f"mode must be 'extra_buffer' or 'no_buffer', not {self.mode!r}")

    @property
    def tracks(self) -> bool:
        return self.prefix_cache and self.mode == "extra_buffer"


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was built (ReplaySSM flushes are counted by the engine)."""

    kv_matched_tokens: int = 0     # prompt tokens whose KV matched at admission
    reused_tokens: int = 0         # prompt tokens not recomputed (state matched: resume_len)
    discarded_kv_tokens: int = 0   # KV matched past the resume point (no state there)
    states_tracked: int = 0
    tracks_skipped: int = 0        # track() found no state slot even after evicting: not cached
    states_donated: int = 0        # states the tree took (track donations + no_buffer finals)
    states_evicted: int = 0
    kv_evicted_tokens: int = 0
    peak_kv_used: int = 0          # KV slots owned by requests or tree, at most
    peak_states_used: int = 0
