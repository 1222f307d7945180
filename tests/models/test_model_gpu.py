"""The model on CUDA: bf16 through the Triton kernels against the same weights in fp32 through
the torch references (BATCHINFER_KERNELS=ref). Skipped without CUDA; the full report with the
27B preset is benchmarks/model_gpu.py."""
from __future__ import annotations

import pytest
import torch

from batchinfer.models import HybridModel, PRESETS, model_config_from_dict, random_model
from batchinfer.models.layers.mlp import SparseMoE
from benchmarks.model_gpu import record_routing, routing_flips
from tests.conftest import requires_cuda
from tests.model_utils import PackedDriver

# Real GDN / attention head dims (the kernels' tile shapes), few layers, small width.
SMALL = {**PRESETS["tiny"], "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
SMALL_MOE = {**SMALL, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_experts": 16,
             "num_experts_per_tok": 4, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}


def _pair(raw):
    ref = random_model(model_config_from_dict(raw), torch.float32, "cuda", seed=0)
    fast = HybridModel(ref.config, torch.bfloat16, "cuda")
    fast.load_state_dict(ref.state_dict())
    return fast, ref


def _prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return {i: torch.randint(0, vocab, (n,), generator=g).tolist() for i, n in enumerate((1, 63, 64, 65, 300))}


@requires_cuda
@pytest.mark.parametrize("raw", [SMALL, SMALL_MOE], ids=["dense", "moe"])
def test_bf16_prefill_logits_close_to_fp32_reference(raw, monkeypatch):
    fast, ref = _pair(raw)
    prompts = _prompts(ref.config.vocab_size)
    results = []
    for model, kernels in ((fast, "auto"), (ref, "ref")):
        monkeypatch.setenv("BATCHINFER_KERNELS", kernels)
        driver = PackedDriver(model, num_state_slots=8)
        for sid in prompts:
            driver.add(sid, 7 - sid)
        results.append(driver.prefill(prompts, all_logits=True))
    for sid in prompts:
        got, want = results[0][sid], results[1][sid]
        assert ((got - want).norm() / want.norm()).item() < 2e-2  # RMS-relative over all positions
        if not ref.config.num_experts:  # MoE: a near-tied top-k flip is a legitimate local jump
            assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


@requires_cuda
@pytest.mark.parametrize("ring_len, ckpt_dtype", [(None, None), (8, torch.float32), (8, torch.bfloat16)],
                         ids=["recurrent", "replay-fp32", "replay-bf16"])
def test_bf16_decode_follows_fp32_reference(ring_len, ckpt_dtype, monkeypatch):
    """Teacher-forced: at each of 48 steps both models see the reference's tokens."""
    fast, ref = _pair(SMALL)
    prompt, steps = _prompts(ref.config.vocab_size)[4], 48
    monkeypatch.setenv("BATCHINFER_KERNELS", "ref")
    reference = PackedDriver(ref, num_state_slots=4)
    reference.add(0, 3)
    ref_tokens = reference.greedy({0: prompt}, steps)[0]
    monkeypatch.setenv("BATCHINFER_KERNELS", "auto")
    driver = PackedDriver(fast, num_state_slots=4, replay_ring_len=ring_len, ckpt_dtype=ckpt_dtype)
    driver.add(0, 1)
    logits, agree = driver.prefill({0: prompt})[0], 0
    for tok in ref_tokens:
        agree += int(logits.argmax()) == tok
        logits = driver.decode({0: tok})[0]
    assert agree / steps >= 0.9


@requires_cuda
def test_bf16_moe_logits_close_where_routing_agrees(monkeypatch):
    """The MoE excess error is routing flips on near-ties: tokens whose top-k sets agreed in
    every layer must meet the dense max-abs target."""
    fast, ref = _pair(SMALL_MOE)
    prompts = _prompts(ref.config.vocab_size)
    results, routes = [], []
    for model, kernels in ((fast, "auto"), (ref, "ref")):
        monkeypatch.setenv("BATCHINFER_KERNELS", kernels)
        driver = PackedDriver(model, num_state_slots=8)
        for sid in prompts:
            driver.add(sid, 7 - sid)
        with record_routing(model) as layer_routes:
            results.append(driver.prefill(prompts, all_logits=True))
        routes.append(layer_routes)
    consistent = ~routing_flips(*routes).any(0)  # [T], prompts packed in order
    assert consistent.float().mean() > 0.5  # flips are rare, not systematic
    start = 0
    for sid, tokens in prompts.items():
        rows = consistent[start:start + len(tokens)].cuda()
        start += len(tokens)
        got, want = results[0][sid][rows], results[1][sid][rows]
        if len(want):
            assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def test_routing_recorder_finds_exactly_the_flipped_layer():
    """CPU check of the benchmark's instrument: identical twins never flip; a perturbed router
    in one MoE layer flips only that layer's decisions."""
    raw = {**SMALL_MOE, "hidden_size": 64, "head_dim": 32, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "vocab_size": 256, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}
    base = random_model(model_config_from_dict(raw), torch.float32, "cpu", seed=0)
    twin = HybridModel(base.config, torch.float32, "cpu")
    twin.load_state_dict(base.state_dict())
    prompts = {0: list(range(3, 40)), 1: list(range(100, 165))}
    moe_layers = [layer.mlp for layer in twin.layers if isinstance(layer.mlp, SparseMoE)]

    def routes_of(model):
        driver = PackedDriver(model, num_state_slots=4)
        for sid in prompts:
            driver.add(sid, 2 - sid)
        with record_routing(model) as layer_routes:
            driver.prefill(prompts)
        return layer_routes

    base_routes = routes_of(base)
    assert len(base_routes) == len(moe_layers) and not routing_flips(base_routes, routes_of(twin)).any()
    with torch.no_grad():
        moe_layers[-1].router.copy_(torch.randn(moe_layers[-1].router.shape, generator=torch.Generator().manual_seed(1)))
    flips = routing_flips(base_routes, routes_of(twin))  # the last MoE layer feeds no later router
    assert flips[-1].any() and not flips[:-1].any()
