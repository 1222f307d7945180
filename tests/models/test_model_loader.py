"""Checkpoint loading: layouts, the random checkpoint writer, presets, and CheckpointErrors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchinfer.models import (
    CheckpointError,
    build_model,
    load_model,
    model_config_from_dict,
    random_model,
    write_random_checkpoint,
)
from batchinfer.models.presets import PRESETS
from tests.model_utils import PackedDriver, hf_logits, hf_reference, make_tiny_checkpoint

TOKENS = [5, 17, 200, 3, 99, 42, 7, 7, 150, 1, 64, 128, 31]


@pytest.fixture(scope="module")
def next_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("loader"), "qwen3_next", seed=5)


def copy_with(src, dst, edit):
    """Copy a single-file checkpoint, applying `edit(tensors)` to its tensor dict."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def prefill_logits(model, tokens=TOKENS):
    driver = PackedDriver(model, num_state_slots=2, num_kv_slots=128)
    driver.add(0, 1)
    return driver.prefill({0: tokens}, all_logits=True)[0]


def assert_same_parameters(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_stacked_expert_layout_loads_the_same_weights(next_checkpoint, tmp_path):
    """transformers' in-memory MoE layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""
    def stack(tensors):
        for layer in range(4):
            base = f"model.layers.{layer}.mlp.experts."
            if base + "0.gate_proj.weight" not in tensors:
                continue  # the dense layer
            gate_up, down = [], []
            for e in range(8):
                gate = tensors.pop(f"{base}{e}.gate_proj.weight")
                up = tensors.pop(f"{base}{e}.up_proj.weight")
                gate_up.append(torch.cat([gate, up]))
                down.append(tensors.pop(f"{base}{e}.down_proj.weight"))
            tensors[base + "gate_up_proj"] = torch.stack(gate_up)
            tensors[base + "down_proj"] = torch.stack(down)

    stacked = copy_with(next_checkpoint, tmp_path / "stacked", stack)
    assert_same_parameters(load_model(next_checkpoint, torch.float32), load_model(stacked, torch.float32))


def test_vision_and_mtp_tensors_are_skipped(next_checkpoint, tmp_path):
    def add_extras(tensors):
        tensors["mtp.fc.weight"] = torch.randn(4, 4)
        tensors["model.visual.patch_embed.weight"] = torch.randn(4, 4)

    extra = copy_with(next_checkpoint, tmp_path / "extra", add_extras)
    assert_same_parameters(load_model(next_checkpoint, torch.float32), load_model(extra, torch.float32))


def test_weights_land_in_the_requested_dtype(next_checkpoint):
    model = load_model(next_checkpoint, torch.bfloat16)
    mixer = model.layers[0].mixer
    assert model.embed.dtype == torch.bfloat16 and mixer.A_log.dtype == torch.float32


@pytest.mark.parametrize("edit, fragments", [
    (lambda t: t.pop("model.layers.2.linear_attn.dt_bias"), ["model.layers.2.linear_attn.dt_bias", "missing"]),
    (lambda t: t.update({"model.layers.3.self_attn.k_proj.weight": torch.randn(63, 64)}),
     ["model.layers.3.self_attn.k_proj.weight", "model.safetensors", "[63, 64]", "expected [64, 64]"]),
    (lambda t: t.update({"model.layers.0.linear_attn.conv1d.bias": torch.randn(128)}),
     ["unexpected tensor", "conv1d.bias"]),
    (lambda t: t.pop("lm_head.weight"), ["lm_head.weight"]),
])
def test_broken_checkpoints_name_the_tensor(next_checkpoint, tmp_path, edit, fragments):
    broken = copy_with(next_checkpoint, tmp_path / "broken", edit)
    with pytest.raises(CheckpointError) as err:
        load_model(broken, torch.float32)
    assert all(f in str(err.value) for f in fragments), str(err.value)


def test_truncated_file_names_the_file(next_checkpoint, tmp_path):
    broken = copy_with(next_checkpoint, tmp_path / "truncated", lambda t: None)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(broken, torch.float32)


def test_missing_shard_names_the_file_and_a_tensor(tmp_path):
    sharded = make_tiny_checkpoint(tmp_path, "qwen3_5", sharded=True, seed=1)
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(weight_map.values()))[1]
    (sharded / victim).unlink()
    with pytest.raises(CheckpointError) as err:
        load_model(sharded, torch.float32)
    assert victim in str(err.value) and "model." in str(err.value)


def test_no_weights_at_all(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path, torch.float32)


@pytest.mark.parametrize("base, overrides", [
    ("tiny", {"tie_word_embeddings": True}),  # tied head: no lm_head tensor at all
    ("tiny", {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
])
def test_written_random_checkpoint_loads_here_and_in_transformers(tmp_path, base, overrides):
    config = {**PRESETS[base], **overrides}
    path = write_random_checkpoint(tmp_path / "ckpt", config, seed=9, dtype=torch.float32)
    ours = load_model(path, torch.float32)
    theirs = hf_reference(path)
    ref = hf_logits(theirs, TOKENS)
    assert ((prefill_logits(ours) - ref).abs().max() / ref.abs().max()) < 1e-4
    assert ours.lm_head is None if config.get("tie_word_embeddings") else ours.lm_head is not None
    again = write_random_checkpoint(tmp_path / "again", config, seed=9, dtype=torch.float32)
    assert_same_parameters(ours, load_model(again, torch.float32))  # deterministic by seed


def test_build_model_presets_are_deterministic_by_seed(tmp_path):
    a, b = build_model("tiny", torch.float32, "cpu", seed=1), build_model("tiny", torch.float32, "cpu", seed=1)
    assert_same_parameters(a, b)
    c = build_model("tiny", torch.float32, "cpu", seed=2)
    assert not torch.equal(a.embed, c.embed)
    path = make_tiny_checkpoint(tmp_path, "qwen3_5", seed=0)
    assert build_model(path, torch.float32, "cpu").lm_head is not None  # a path loads the checkpoint


def test_random_weights_stay_finite_through_a_deep_stack():
    """A 48-layer stack (the real depth range) at tiny width: logits finite and of sane scale."""
    config = model_config_from_dict({**PRESETS["tiny"], "num_hidden_layers": 48})
    logits = prefill_logits(random_model(config, torch.float32, "cpu", seed=0), tokens=list(range(70)))
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 10
