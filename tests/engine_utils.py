"""Shared helpers for the engine tests: tiny models, workloads, running an engine to the end."""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.presets import preset_config, random_model

TINY_VOCAB = 512


def tiny_model(seed: int = 0):
    """The `tiny` preset (4 layers: 3 GDN + 1 attention) with random fp32 weights on the CPU."""
    return random_model(preset_config("tiny"), torch.float32, "cpu", seed=seed)


def tiny_moe_model(dtype: torch.dtype = torch.float32, seed: int = 0):
    """The 35B-A3B preset's MoE layout at toy sizes (4 layers, 16 experts, top-2) on the CPU."""
    from batchinfer.models.config import model_config_from_dict
    from batchinfer.models.presets import PRESETS

    raw = dict(PRESETS["qwen3.5-35b-a3b"], vocab_size=256, hidden_size=64, num_hidden_layers=4, head_dim=32,
               num_attention_heads=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)
    return random_model(model_config_from_dict(raw), dtype, "cpu", seed=seed)


def make_engine(model, **settings) -> Engine:
    base = dict(device="cpu", dtype="fp32", memory_budget_bytes=16 << 20, ring_len=4, track_interval=32)
    return Engine(model, EngineConfig(**{**base, **settings}))


def collect(engine: Engine, stream) -> dict:
    """(request_id, sample_index) → RequestOutput of `stream` (the engine's generator); checks that
    none streams twice and that the cache audits clean with nothing left running."""
    outputs = {}
    for out in stream:
        key = (out.request_id, out.sample_index)
        assert key not in outputs, f"{key} streamed twice"
        outputs[key] = out
    engine.cache.audit()
    assert not engine.cache.running
    return outputs


def run(engine: Engine, requests) -> dict:
    """`collect` over engine.generate(requests); also checks the pool holds only the tree's tokens."""
    outputs = collect(engine, engine.generate(requests))
    assert engine.cache.kv_pool.num_used == engine.cache.tree.num_kv_tokens
    return outputs


def shared_prefix_prompts(seed: int = 0, groups: int = 3, per_group: int = 4, prefix_len: int = 70):
    """`groups` × `per_group` prompts sharing a per-group prefix, unique odd-length suffixes, plus
    nested sharing: a prompt extending a whole earlier prompt, and one sharing half a prefix."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(TINY_VOCAB) for _ in range(prefix_len)]
        for i in range(per_group):
            prompts.append(prefix + [rng.randrange(TINY_VOCAB) for _ in range(2 * i + 1)])
    prompts.append(prompts[1] + [rng.randrange(TINY_VOCAB) for _ in range(5)])
    prompts.append(prompts[0][:prefix_len // 2] + [rng.randrange(TINY_VOCAB) for _ in range(9)])
    order = list(range(len(prompts)))
    rng.shuffle(order)  # plan order must not depend on input order
    return [prompts[i] for i in order]


def requests_for(prompts, params: SamplingParams, n_of=None):
    """Request i gets seed_key i, and `n_of(i)` samples when given (else params.n)."""
    return [Request(request_id=i, prompt_token_ids=tuple(p), seed_key=i,
                    sampling=params if n_of is None else replace(params, n=n_of(i)))
            for i, p in enumerate(prompts)]


def tokens_of(outputs: dict) -> dict:
    return {key: out.token_ids for key, out in outputs.items()}


def demo_engine_fp32(seed: int = 2) -> Engine:
    """An fp32 CPU engine over a random model of the demo's config (its vocabulary fits the
    tokenizer fixtures), small pools and ReplaySSM ring 4."""
    from batchinfer.demo import DEMO_CONFIG
    from batchinfer.models.config import model_config_from_dict

    model = random_model(model_config_from_dict(DEMO_CONFIG), torch.float32, "cpu", seed=seed)
    return Engine(model, EngineConfig(device="cpu", dtype="fp32", memory_budget_bytes=16 << 20, ring_len=4,
                                      track_interval=16))
