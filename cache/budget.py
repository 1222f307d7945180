"""Sizing the two pools from a byte budget and the model's shapes.

State slots are large (Qwen3.5-27B: ~150 MB each in fp32) and every running request holds
one of them (its working slot) for its whole life, so the budget decides how many requests can
run at once. Beside the working slots the state pool keeps a shared pool of cached states:
prefix states in the radix tree, and the transient snapshot an extra_buffer `track` takes just
before donating it to the tree (tracking borrows from this pool, evicting the least recently
used cached state when it is full). The rest of the budget becomes KV slots (tokens) shared by
running requests and the prefix cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kv_pool import KVPool
from .shapes import GdnStateShape, KVShape
from .state_pool import GdnStatePool


@dataclass(frozen=True)
class PoolPlan:
    kv_slots: int                 # tokens of KV the pool holds
    state_slots: int              # GDN state slots
    max_running: int              # requests that can run at once (each holding slots_per_request)
    cache_state_slots: int        # state slots beyond the running requests' own: cached + tracked states
    bytes_per_kv_token: int
    bytes_per_state_slot: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_slots * self.bytes_per_kv_token

    @property
    def state_bytes(self) -> int:
        return self.state_slots * self.bytes_per_state_slot

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    def describe(self) -> str:
        gib = 2 ** 30
        return (f"{self.max_running} running requests, {self.state_slots} state slots "
                f"({self.state_bytes / gib:.2f} GiB, {self.cache_state_slots} for cached prefixes), "
                f"{self.kv_slots} KV tokens ({self.kv_bytes / gib:.2f} GiB)")


def cache_states_for(running: int, cache_states_per_request: float, min_cache_states: int) -> int:
    """Size of the cached/transient state pool beside `running` working slots."""
    return max(min_cache_states, math.ceil(running * cache_states_per_request))


def plan_pools(kv_shape: KVShape, state_shape: GdnStateShape, budget_bytes: int, *, max_running: int,
               slots_per_request: int = 1, cache_states_per_request: float = 0.25, min_cache_states: int = 8,
               max_state_fraction: float = 0.5, min_kv_tokens: int = 256) -> PoolPlan:
    """Split `budget_bytes` between the state pool and the KV pool.

    States get `max_running` × `slots_per_request` working slots (1: a running request holds one)
    plus a pool of `max(min_cache_states, ⌈max_running × cache_states_per_request⌉)` cached /
    transient states (prefix states in the tree and extra_buffer snapshots on their way there),
    but at most `max_state_fraction` of the budget: if that does not fit, `max_running` shrinks.
    The rest becomes KV. Raises ValueError when not even one request, its cache pool and
    `min_kv_tokens` of KV fit.
    """
    if max_running < 1 or slots_per_request < 1:
        raise ValueError("max_running and slots_per_request must be >= 1")
    if not 0 < max_state_fraction < 1:
        raise ValueError("max_state_fraction must be in (0, 1)")
    if cache_states_per_request < 0 or min_cache_states < 0:
        raise ValueError("cache_states_per_request and min_cache_states must be >= 0")
    kv_token, state_slot = kv_shape.bytes_per_token, state_shape.bytes_per_slot
    if kv_token <= 0 or state_slot <= 0:
        raise ValueError("the model needs both attention (KV) and GDN (state) layers")
    max_slots = int(budget_bytes * max_state_fraction // state_slot)

    def slots_needed(n: int) -> int:
        return n * slots_per_request + cache_states_for(n, cache_states_per_request, min_cache_states)

    running = min(max_running, int(max_slots // (slots_per_request + cache_states_per_request)))
    while running >= 1 and slots_needed(running) > max_slots:  # the ceil / the minimum pool
        running -= 1
    if running < 1:
        raise ValueError(f"memory budget {budget_bytes / 2**20:.0f} MiB cannot hold one request's "
                         f"GDN states and a cache pool ({slots_needed(1)} slots of "
                         f"{state_slot / 2**20:.1f} MiB within {max_state_fraction:.0%})")
    cache_states = cache_states_for(running, cache_states_per_request, min_cache_states)
    state_slots = running * slots_per_request + cache_states
    kv_slots = (budget_bytes - state_slots * state_slot) // kv_token
    if kv_slots < min_kv_tokens:
        raise ValueError(f"memory budget leaves {kv_slots} KV tokens, fewer than {min_kv_tokens}")
    return PoolPlan(kv_slots=int(kv_slots), state_slots=state_slots, max_running=running,
                    cache_state_slots=cache_states, bytes_per_kv_token=kv_token,
                    bytes_per_state_slot=state_slot)


def memory_budget(device: torch.device | str, fraction: float, *, reserve_bytes: int = 0,
                  cpu_total_bytes: int | None = None) -> int:
    """`fraction` of the device's free memory now (CUDA), but never more than the free memory
    less `reserve_bytes` (what the steps need besides the pools: the engine passes
    `batchinfer.engine.build.activation_reserve_bytes`); or `fraction` of
    `cpu_total_bytes` (CPU). Raises ValueError when the reserve alone exceeds the free memory."""
    device = torch.device(device)
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return pool_budget(free, fraction, reserve_bytes)
    if cpu_total_bytes is None:
        raise ValueError("on the CPU give cpu_total_bytes (there is no free-memory query)")
    return int(cpu_total_bytes * fraction)


def pool_budget(free_bytes: int, fraction: float, reserve_bytes: int) -> int:
    """min(fraction · free, free − reserve): on a big device the fraction leaves far more than the
    activations need; on a nearly full one the reserve is what keeps a step from running out."""
    left = free_bytes - reserve_bytes
    if left <= 0:
        raise ValueError(f"{free_bytes / 2**30:.2f} GiB of device memory free, but one step's activations "
                         f"need ~{reserve_bytes / 2**30:.2f} GiB: lower max_batch_tokens or max_running, "
                         f"or free the device")
    return min(int(free_bytes * fraction), left)


def build_pools(plan: PoolPlan, kv_shape: KVShape, state_shape: GdnStateShape,
                device: torch.device | str) -> tuple[KVPool, GdnStatePool]:
    return KVPool(plan.kv_slots, kv_shape, device), GdnStatePool(plan.state_slots, state_shape, device)


# Below this a decode step reads the weights for too few rows (27B 8k/1k: 48 rows ran 7,596 tok/s
# against 8,925 at 96); rows that then outgrow the KV are preempted and recomputed.
MIN_SIZED_RUNNING = 64
SIZED_RUNNING_GRANULE = 8  # a few distinct values: each is a trace (manifest) and a graph ladder


def size_max_running(budget_bytes: int, kv_bytes_per_token: int, state_bytes_per_slot: int, row_tokens: int,
                     cap: int, *, kv_fill: float = 0.9, cache_states_per_request: float = 0.25,
                     floor: int = MIN_SIZED_RUNNING, granule: int = SIZED_RUNNING_GRANULE) -> int:
    """Rows to run at once so that each holds `row_tokens` KV positions (its prompt tokens not shared
    with other rows + its output) within `kv_fill` of the KV pool left beside their GDN states
    (`plan_pools`' working slot and cache share per row): r = budget / (state_slot · (1 + cache
    share) + row_tokens · kv_token / kv_fill), rounded down to `granule`, within [floor, cap].

    27B bf16 on one H200 (~79 GB of pools, 87 MiB state slots, 64 KiB a KV position) with 8,192 +
    1,024-token rows: 96, the best measured setting (8,925 tok/s; 8,375 at the default 256, whose
    states leave the KV ~81 such rows and preempt). Short or shared rows get `cap`."""
    if min(kv_bytes_per_token, state_bytes_per_slot, row_tokens, cap) < 1 or not 0 < kv_fill <= 1:
        raise ValueError("kv_bytes_per_token, state_bytes_per_slot, row_tokens, cap must be >= 1 "
                         "and kv_fill in (0, 1]")
    per_row = state_bytes_per_slot * (1 + cache_states_per_request) + row_tokens * kv_bytes_per_token / kv_fill
    rows = int(budget_bytes // per_row) // granule * granule
    return max(min(floor, cap), min(rows, cap))
