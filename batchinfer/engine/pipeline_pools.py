"""The pools of a pipelined engine: one KV and one GDN state pool per stage, on its device.

On the CPU the slot counts are those of the whole model in the whole budget (a pipelined
engine then schedules exactly as a plain one); on CUDA each stage is priced by its own layers
against its device's free memory (shared evenly by the stages placed on one GPU), and every
stage gets the slot counts of the tightest one.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from batchinfer.cache.budget import PoolPlan, memory_budget, plan_pools
from batchinfer.cache.shapes import GdnStateShape, KVShape
from batchinfer.cache.staged_pools import StagedKVPool, StagedStatePool, StageShapes, plan_stage_pools


def stage_shapes(model, kv_shape: KVShape, state_shape: GdnStateShape) -> list[StageShapes]:
    return [StageShapes(kv=replace(kv_shape, num_layers=stage.num_attn_layers),
                        state=replace(state_shape, num_layers=stage.num_gdn_layers)) for stage in model.stages]


def plan_pipeline_pools(model, kv_shape: KVShape, state_shape: GdnStateShape, *, max_running: int,
                        cpu_budget: int, fraction: float, reserve_bytes: int,
                        budget_bytes: int | None = None) -> PoolPlan:
    """`budget_bytes` (an explicit pool budget) or the CPU budget is the whole model's, as for one stage."""
    devices = model.devices
    if budget_bytes is not None or devices[0].type != "cuda":
        return plan_pools(kv_shape, state_shape, budget_bytes or cpu_budget, max_running=max_running)
    sharing = Counter(devices)
    budgets = [memory_budget(d, fraction, reserve_bytes=reserve_bytes) // sharing[d] for d in devices]
    return plan_stage_pools(stage_shapes(model, kv_shape, state_shape), budgets, max_running=max_running)


def build_pipeline_pools(model, plan: PoolPlan, kv_shape: KVShape,
                         state_shape: GdnStateShape) -> tuple[StagedKVPool, StagedStatePool]:
    shapes = stage_shapes(model, kv_shape, state_shape)
    devices: list[torch.device] = model.devices
    return (StagedKVPool(plan.kv_slots, [s.kv for s in shapes], devices),
            StagedStatePool(plan.state_slots, [s.state for s in shapes], devices))
