"""State cache: KV and GDN state pools, the radix prefix tree, and the strategy the engine drives.

Typical use (the engine):

    kv_shape, state_shape = shapes_from_model_config(config, dtype, ring_len=16, ckpt_dtype=torch.bfloat16)
    plan = plan_pools(kv_shape, state_shape, budget_bytes, max_running=256)  # 1 working slot each + cache pool
    kv_pool, state_pool = build_pools(plan, kv_shape, state_shape, device)
    cache = StateCache(kv_pool, state_pool, CacheConfig(mode="extra_buffer"))
    caches = ModelCaches.from_pools(kv_pool, state_pool)  # the model's view (batchinfer.models.forward_batch)
    seq = cache.admit(request_id, prompt_ids)      # then see StateCache's docstring
"""
from .budget import PoolPlan, build_pools, memory_budget, plan_pools
from .cache_config import CacheConfig, CacheStats, StateCacheMode
from .kv_pool import KVPool
from .radix_tree import Evicted, InsertResult, MatchResult, RadixNode, RadixTree
from .seq_handle import SeqHandle
from .shapes import GdnStateShape, KVShape, shapes_from_model_config
from .slot_owner import DoubleFreeError, FreeList
from .state_cache import StateCache
from .state_pool import GdnStatePool

__all__ = [
    "CacheConfig", "CacheStats", "DoubleFreeError", "Evicted", "FreeList", "GdnStatePool", "GdnStateShape",
    "InsertResult", "KVPool", "KVShape", "MatchResult", "PoolPlan", "RadixNode", "RadixTree", "SeqHandle",
    "StateCache", "StateCacheMode", "build_pools", "memory_budget", "plan_pools", "shapes_from_model_config",
]
