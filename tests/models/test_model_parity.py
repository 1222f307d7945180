"""HybridModel (fp32, CPU, kernel references) against transformers on tiny checkpoints.

Checkpoints are written by transformers itself with every init-constant weight perturbed, in
all supported layouts: dense Qwen3.5, Qwen3-Next (fused qkvz/ba, MoE + one dense layer, no
top-k renormalisation), Qwen3.5-MoE, and a VLM-layout Qwen3.5 (model.language_model.*).
"""
from __future__ import annotations

import pytest
import torch

from batchinfer.models import load_model
from tests.model_utils import KINDS, PackedDriver, hf_greedy, hf_logits, hf_reference, make_tiny_checkpoint

PROMPT_LENGTHS = (1, 63, 64, 65, 300)  # around the 64-token chunk boundary, and several chunks
REL_TOL = 1e-4


def random_tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_parity")
    return {kind: make_tiny_checkpoint(root, kind, seed=3) for kind in KINDS}


@pytest.fixture(scope="module")
def models(checkpoints):
    return {kind: (load_model(path, torch.float32, "cpu"), hf_reference(path)) for kind, path in checkpoints.items()}


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_packed_prefill_logits_match_transformers(models, kind):
    """All prompt lengths in ONE packed prefill, logits at every position vs transformers."""
    ours, ref = models[kind]
    driver = PackedDriver(ours, num_state_slots=8, seed=1)
    prompts = {n: random_tokens(n, seed=n) for n in PROMPT_LENGTHS}
    for sid, slot in zip(prompts, (6, 1, 4, 0, 7)):  # slots out of sequence order
        driver.add(sid, slot)
    logits = driver.prefill(prompts, all_logits=True)
    for n, tokens in prompts.items():
        err = relative_error(logits[n], hf_logits(ref, tokens))
        assert err < REL_TOL, f"{kind}: prompt of {n} tokens differs from transformers by {err:.2e}"


GREEDY_STEPS = 32
GREEDY_PROMPTS = {"a": random_tokens(37, seed=11), "b": random_tokens(64, seed=12), "c": random_tokens(5, seed=13)}


@pytest.fixture(scope="module")
def hf_generations(models):
    """transformers' greedy continuations, computed once per kind for both decode modes."""
    cache = {}

    def get(kind: str) -> dict:
        if kind not in cache:
            ref = models[kind][1]
            cache[kind] = {sid: hf_greedy(ref, p, GREEDY_STEPS) for sid, p in GREEDY_PROMPTS.items()}
        return cache[kind]

    return get


# The two distinct code paths: dense Qwen3.5 (split projections) and Qwen3-Next (fused, MoE).
# The VLM copy and Qwen3.5-MoE differ only in loading / routing, which prefill parity covers.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("ring_len", [None, 8], ids=["recurrent", "replay-L8"])
def test_greedy_decode_matches_transformers(models, hf_generations, kind, ring_len):
    """Prefill then 32 batched decode steps: token-for-token equal to transformers' greedy.

    With ReplaySSM L=8 the ring fills and is folded three times during the 31 decode steps.
    """
    driver = PackedDriver(models[kind][0], num_state_slots=6, replay_ring_len=ring_len, seed=2)
    for sid, slot in zip(GREEDY_PROMPTS, (5, 2, 3)):
        driver.add(sid, slot)
    generated = driver.greedy(GREEDY_PROMPTS, GREEDY_STEPS)
    expected = hf_generations(kind)
    for sid in GREEDY_PROMPTS:
        assert generated[sid] == expected[sid], f"{kind}: sequence {sid} diverged"


def test_packed_batch_equals_each_sequence_alone(models):
    """Packing must not leak anything between sequences (states, conv windows, attention)."""
    ours, _ = models["qwen3_next"]
    prompts = {i: random_tokens(n, seed=100 + i) for i, n in enumerate((65, 1, 130, 64, 7))}
    packed = PackedDriver(ours, num_state_slots=8, seed=3)
    for sid in prompts:
        packed.add(sid, 7 - sid)
    together = packed.prefill(prompts, all_logits=True)
    for sid, tokens in prompts.items():
        alone = PackedDriver(ours, num_state_slots=8, seed=4)
        alone.add(sid, 0)
        single = alone.prefill({sid: tokens}, all_logits=True)[sid]
        assert relative_error(together[sid], single) < 1e-5


@pytest.mark.parametrize("ring_len", [None, 4], ids=["recurrent", "replay-L4"])
def test_prefill_after_decode_continues_the_sequence(models, ring_len):
    """Prompt, decode 10 tokens, then more prompt tokens (a chat turn) in prefill, chunked
    across a 64 boundary: logits equal transformers on the whole sequence. Under ReplaySSM the
    slot still has pending ring entries (cursor 10 % 4 ≠ 0) when the prefill starts."""
    ours, ref = models["qwen3_5"]
    driver = PackedDriver(ours, num_state_slots=4, replay_ring_len=ring_len, seed=5)
    driver.add("s", 2)
    prompt, turn = random_tokens(40, seed=21), random_tokens(70, seed=22)
    generated = driver.greedy({"s": prompt}, steps=11)["s"]
    driver.decode({"s": generated[-1]})
    logits = driver.prefill({"s": turn}, all_logits=True)["s"]
    full = hf_logits(ref, prompt + generated + turn)
    assert relative_error(logits, full[-len(turn):]) < REL_TOL


def test_sharded_checkpoint_loads_the_same_weights(checkpoints, tmp_path):
    for kind in ("qwen3_next", "qwen3_5_vlm"):
        sharded = make_tiny_checkpoint(tmp_path, kind, sharded=True, seed=3)
        assert (sharded / "model.safetensors.index.json").exists()
        a = load_model(checkpoints[kind], torch.float32, "cpu").state_dict()
        b = load_model(sharded, torch.float32, "cpu").state_dict()
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
