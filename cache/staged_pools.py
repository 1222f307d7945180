"""Pools of a pipelined model: one KV pool and one GDN state pool per stage, owned as one.

Each stage's pools hold only its own layers, on its device, with the same number of slots: a
slot index means the same row on every stage, so the radix tree, the free lists and every
`StateCache` rule stay as they are. `StagedKVPool` / `StagedStatePool` are what the cache sees:
one free list (slots are handed out once, for all stages) and every state move (`zero_`,
`copy`, `flush`, `reset_cursor`) done on every stage, so a prefix state snapshot moves in step.

`plan_stage_pools` sizes them: the same slot counts on every stage, the most that fit on the
tightest stage (each stage priced by its own layers against its own device's budget).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .budget import PoolPlan, cache_states_for
from .kv_pool import KVPool
from .shapes import GdnStateShape, KVShape
from .slot_owner import SlotPool
from .state_pool import GdnStatePool


class StagedKVPool(SlotPool):
    def __init__(self, num_slots: int, shapes: Sequence[KVShape], devices: Sequence[torch.device]) -> None:
        super().__init__(num_slots)
        self.stages = [KVPool(num_slots, shape, device) for shape, device in zip(shapes, devices)]
        self.shape = shapes[0]

    def alloc(self, n: int) -> torch.Tensor | None:
        return self._free.alloc(n)

    def free(self, idx: torch.Tensor | Iterable[int]) -> None:
        self._free.free(idx)


class StagedStatePool(SlotPool):
    def __init__(self, num_slots: int, shapes: Sequence[GdnStateShape], devices: Sequence[torch.device]) -> None:
        super().__init__(num_slots)
        self.stages = [GdnStatePool(num_slots, shape, device) for shape, device in zip(shapes, devices)]
        self.shape = shapes[0]  # ring_len and replay are the same on every stage

    def alloc(self) -> int | None:
        idx = self._free.alloc(1)
        return None if idx is None else int(idx[0])

    def free(self, slot: int | Iterable[int]) -> None:
        self._free.free([slot] if isinstance(slot, int) else list(slot))

    def zero_(self, slots) -> None:
        for pool in self.stages:
            pool.zero_(slots)

    def copy(self, src, dst) -> None:
        for pool in self.stages:
            pool.copy(src, dst)

    def flush(self, slots) -> None:
        for pool in self.stages:
            pool.flush(slots)

    def reset_cursor(self, slots) -> None:
        for pool in self.stages:
            pool.reset_cursor(slots)


@dataclass(frozen=True)
class StageShapes:
    kv: KVShape
    state: GdnStateShape


def plan_stage_pools(stages: Sequence[StageShapes], budgets: Sequence[int], *, max_running: int,
                     cache_states_per_request: float = 0.25, min_cache_states: int = 8,
                     max_state_fraction: float = 0.5, min_kv_tokens: int = 256) -> PoolPlan:
    """`budget.plan_pools` over stages: the running requests and KV tokens every stage fits
    (`budgets[s]`: the pool bytes of stage s). Raises ValueError when a stage cannot hold one
    request, its cache pool and `min_kv_tokens` of KV."""
    def slots_needed(n: int) -> int:
        return n + cache_states_for(n, cache_states_per_request, min_cache_states)

    running = max_running
    for shape, budget in zip(stages, budgets):
        per_slot = shape.state.bytes_per_slot
        if shape.state.num_layers == 0:
            continue
        max_slots = int(budget * max_state_fraction // per_slot)
        running = min(running, int(max_slots // (1 + cache_states_per_request)))
        while running >= 1 and slots_needed(running) > max_slots:
            running -= 1
    if running < 1:
        raise ValueError("memory budget of a pipeline stage cannot hold one request's GDN states and a cache pool")
    state_slots = slots_needed(running)
    kv_slots = math.inf
    for shape, budget in zip(stages, budgets):
        if shape.kv.num_layers:
            left = budget - state_slots * shape.state.bytes_per_slot * (shape.state.num_layers > 0)
            kv_slots = min(kv_slots, left // shape.kv.bytes_per_token)
    if kv_slots == math.inf:
        raise ValueError("the model needs attention (KV) layers")
    if kv_slots < min_kv_tokens:
        raise ValueError(f"memory budget of a pipeline stage leaves {kv_slots} KV tokens, fewer than {min_kv_tokens}")
    return PoolPlan(kv_slots=int(kv_slots), state_slots=state_slots, max_running=running,
                    cache_state_slots=state_slots - running,
                    bytes_per_kv_token=sum(s.kv.bytes_per_token for s in stages),
                    bytes_per_state_slot=sum(s.state.bytes_per_slot for s in stages))
