"""FP8 block-quantized checkpoints: the writer's layout, the loader (dequantized on the CPU, or
kept FP8 with the reference GEMM), greedy parity with the dequantized checkpoint, errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchinfer.models import CheckpointError, load_model, write_random_checkpoint
from batchinfer.models.checkpoint_writer import dequantize_checkpoint
from batchinfer.models.fp8_model import dequantized_model, random_fp8_model
from batchinfer.models.layers.fp8_linear import Fp8Weight
from batchinfer.models.presets import PRESETS, preset_config, random_preset_fp8
from tests.model_utils import PackedDriver

TOKENS = [5, 17, 200, 3, 99, 42, 7, 7, 150, 1, 64, 128, 31]
# Small, but with 128-row parts where the 27B / 80B have them (GDN q|k|v|z, MLP, o_proj);
# attention k / v are 64 rows, so the fused qkv_proj cannot be FP8 and stays dequantized.
DENSE = {**PRESETS["tiny"], "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
         "linear_key_head_dim": 128, "linear_value_head_dim": 64}
MOE = {**DENSE, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
       "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
       # Two key-head groups: in_proj_qkvz interleaves them, so its scale rows are regrouped too.
       "linear_num_key_heads": 2, "linear_num_value_heads": 4}
MOE.pop("rope_parameters")


def greedy(model, steps: int = 6) -> tuple[torch.Tensor, list[int]]:
    driver = PackedDriver(model, num_state_slots=2, num_kv_slots=128)
    driver.add(0, 1)
    logits = driver.prefill({0: TOKENS}, all_logits=True)[0]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        tokens.append(int(driver.decode({0: tokens[-1]})[0].argmax()))
    return logits, tokens


@pytest.fixture(scope="module", params=["dense", "moe"])
def fp8_checkpoint(request, tmp_path_factory):
    config = DENSE if request.param == "dense" else MOE
    return write_random_checkpoint(tmp_path_factory.mktemp(request.param) / "fp8", config, seed=3,
                                   dtype=torch.bfloat16, fp8=True)


def test_writer_stores_qwen_fp8_layout(fp8_checkpoint):
    tensors = load_file(fp8_checkpoint / "model.safetensors")
    quant = json.loads((fp8_checkpoint / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    w = tensors["model.layers.0.linear_attn.in_proj_qkv.weight" if "model.layers.0.linear_attn.in_proj_qkv.weight"
                in tensors else "model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert w.dtype == torch.float8_e4m3fn
    scale = tensors[[n for n in tensors if n.endswith("in_proj_qkv.weight_scale_inv")
                     or n.endswith("in_proj_qkvz.weight_scale_inv")][0]]
    assert scale.dtype == torch.float32 and scale.shape == (-(-w.shape[0] // 128), 1)
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert "lm_head" in quant["modules_to_not_convert"]
    assert not any(n.endswith(("in_proj_b.weight_scale_inv", "in_proj_ba.weight_scale_inv")) for n in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_match_the_dequantized_checkpoint(fp8_checkpoint, tmp_path, dtype):
    """On the CPU an FP8 checkpoint loads dequantized: exactly the weights of its dequantized copy."""
    plain = dequantize_checkpoint(fp8_checkpoint, tmp_path / "plain", torch.float32)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    fp8_model, plain_model = load_model(fp8_checkpoint, dtype), load_model(plain, dtype)
    assert fp8_model.fp8_params is None
    (logits_a, tokens_a), (logits_b, tokens_b) = greedy(fp8_model), greedy(plain_model)
    assert torch.equal(logits_a, logits_b)
    assert tokens_a == tokens_b


def test_kept_fp8_weights_are_the_checkpoint_blocks(fp8_checkpoint):
    """Loaded as FP8 (the GPU layout, reference GEMM on the CPU): the block-aligned projections
    are `Fp8Weight`s whose dequantized values are the dequantized load's, bit for bit."""
    kept = load_model(fp8_checkpoint, torch.float32, fp8=True)
    plain = load_model(fp8_checkpoint, torch.float32)
    fp8_modules = {n for n, m in kept.named_modules() if isinstance(m, Fp8Weight)}
    assert {"layers.0.mixer.in_proj", "layers.0.mixer.out_proj", "layers.3.mixer.o_proj"} <= fp8_modules
    assert "layers.3.mixer.qkv_proj" not in fp8_modules  # 64-row k / v parts: not block aligned
    if kept.config.num_experts:
        assert {"layers.0.mlp.experts_gate_up", "layers.0.mlp.shared_expert.down"} <= fp8_modules
    else:
        assert "layers.0.mlp.gate_up" in fp8_modules
    twin = dequantized_model(kept, torch.float32)
    for name, param in plain.named_parameters():
        assert torch.equal(param, dict(twin.named_parameters())[name]), name


def test_fp8_model_logits_near_the_dequantized_model(fp8_checkpoint):
    kept = load_model(fp8_checkpoint, torch.float32, fp8=True)
    logits, _ = greedy(kept, steps=2)
    ref, _ = greedy(dequantized_model(kept, torch.float32), steps=2)
    # The only difference is the activations' e4m3 rounding (~3% per element).
    assert ((logits - ref).abs().max() / ref.abs().max()) < 0.1
    assert not torch.equal(logits, ref)


def test_random_fp8_model_has_the_written_checkpoint_layout(fp8_checkpoint):
    """A random FP8 model (the presets' builder) keeps the same projections FP8 as the loader
    keeps for a checkpoint the writer quantized; on the CPU a preset comes dequantized."""
    loaded = load_model(fp8_checkpoint, torch.float32, fp8=True)
    config = loaded.config
    model = random_fp8_model(config, torch.float32, "cpu", seed=0)
    fp8_of = lambda m: {n for n, mod in m.named_modules() if isinstance(mod, Fp8Weight)}
    assert fp8_of(model) == fp8_of(loaded) and fp8_of(model)
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    cpu = random_preset_fp8(config, torch.float32, "cpu", seed=0)
    assert not fp8_of(cpu)
    twin = dict(dequantized_model(model, torch.float32).named_parameters())
    for name, param in cpu.named_parameters():
        assert torch.equal(param, twin[name]), name
    assert {"qwen3.5-27b-fp8", "qwen3-next-80b-a3b-fp8"} <= set(PRESETS)
    assert preset_config("qwen3.5-27b-fp8") == preset_config("qwen3.5-27b")


def _copy_with_scales_edited(src, dst, edit) -> str:
    """A copy of checkpoint `src` at `dst` whose first out_proj scale tensor `edit(tensors, name)`
    changed; → that tensor's name."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    victim = next(n for n in tensors if n.endswith("out_proj.weight_scale_inv"))
    edit(tensors, victim)
    save_file(tensors, dst / "model.safetensors")
    return victim


def test_fp8_tensor_without_scales_names_it(fp8_checkpoint, tmp_path):
    dst = tmp_path / "broken"
    victim = _copy_with_scales_edited(fp8_checkpoint, dst, lambda tensors, name: tensors.pop(name))
    with pytest.raises(CheckpointError, match=victim.removesuffix("_scale_inv")):
        load_model(dst, torch.float32)


def test_misshapen_scales_name_the_tensor(fp8_checkpoint, tmp_path):
    dst = tmp_path / "broken"
    victim = _copy_with_scales_edited(fp8_checkpoint, dst, lambda tensors, name: tensors.update({name: torch.ones(7, 7)}))
    with pytest.raises(CheckpointError, match=victim):
        load_model(dst, torch.float32, fp8=True)
