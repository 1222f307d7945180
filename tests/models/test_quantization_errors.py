"""Quantized checkpoints the engine cannot run: one line at validation (run and plan), exit 2, nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from batchinfer.models.config import ModelConfigError
from batchinfer.models.quantization import Fp8BlockQuant, check_tensor_names, parse_quantization
from tests.jobs_fixtures import make_tokenizer_checkpoint
from tests.cli.test_cli_errors import run_cli, setup_job

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

UNSUPPORTED_CONFIGS = {
    "awq": ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}, "'awq'"),
    "gptq": ({"quantization_config": {"quant_method": "gptq", "bits": 4, "desc_act": False}}, "'gptq'"),
    "bitsandbytes": ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
                     "'bitsandbytes'"),
    "compressed-tensors": ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}},
                           "'compressed-tensors'"),
    "mxfp4": ({"quantization_config": {"quant_method": "mxfp4"}}, "'mxfp4'"),
    "fp8-per-tensor": ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}},
                       "no weight_block_size"),
    "fp8-blocks": ({"quantization_config": {**FP8, "weight_block_size": [1, 128]}}, "weight_block_size [1, 128]"),
    "fp8-e5m2": ({"quantization_config": {**FP8, "fmt": "e5m2"}}, "fmt 'e5m2'"),
    "fp8-static": ({"quantization_config": {**FP8, "activation_scheme": "static"}}, "activation_scheme 'static'"),
    "text-config": ({"text_config": {"quantization_config": {"quant_method": "awq"}}},
                    "text_config.quantization_config: quant_method 'awq'"),
    "mlx-config": ({"quantization": {"group_size": 64, "bits": 4}}, "MLX quantization (bits 4, group_size 64)"),
    "no-method": ({"quantization_config": {"bits": 4}}, "has no quant_method"),
}

FOREIGN_NAMES = {
    "mlx-scales": (["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.scales",
                    "model.layers.0.mlp.down_proj.biases"], "MLX"),
    "gptq-qweight": (["model.layers.0.mlp.down_proj.qweight"], "GPTQ/AWQ"),
    "bnb-absmax": (["model.layers.0.mlp.down_proj.weight.absmax"], "bitsandbytes"),
    "fp8-scales-without-config": (["model.layers.0.mlp.down_proj.weight_scale_inv"], "no quantization_config"),
    "mlx-vlm-prefix": (["language_model.model.layers.0.mlp.down_proj.weight"],
                       "not a Hugging Face transformers tensor name"),
}


def test_fp8_block_quantization_is_accepted_with_its_settings():
    assert parse_quantization({}) is None
    assert parse_quantization({"quantization_config": FP8}) == Fp8BlockQuant()
    skipped = {**FP8, "modules_to_not_convert": ["lm_head", "mtp"]}
    assert parse_quantization({"text_config": {"quantization_config": skipped}}) == \
        Fp8BlockQuant(block=(128, 128), modules_to_not_convert=("lm_head", "mtp"))
    check_tensor_names(["model.layers.0.mlp.down_proj.weight_scale_inv", "lm_head.weight"], Fp8BlockQuant())


@pytest.mark.parametrize("case", sorted(UNSUPPORTED_CONFIGS))
def test_each_unsupported_quantization_config_is_a_one_line_error_naming_it(case):
    config, named = UNSUPPORTED_CONFIGS[case]
    with pytest.raises(ModelConfigError) as caught:
        parse_quantization(config)
    message = str(caught.value)
    assert named in message and "\n" not in message


def _checkpoint(folder: Path, config_extra: dict = None, names: list[str] = None) -> Path:
    checkpoint = make_tokenizer_checkpoint(folder)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **(config_extra or {})}))
    if names is not None:
        save_file({name: np.zeros((2,), dtype=np.float32) for name in names}, str(checkpoint / "model.safetensors"))
    return checkpoint


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("case", sorted(UNSUPPORTED_CONFIGS))
def test_run_and_plan_refuse_an_unsupported_quantization_config(tmp_path, case, command):
    config, named = UNSUPPORTED_CONFIGS[case]
    checkpoint = _checkpoint(tmp_path / "ckpt", config)
    job = tmp_path / "job"
    setup_job(job, checkpoint)
    line = run_cli(job, command, "jobs.yaml")
    assert line.startswith("error: jobs.yaml: jobs.rag.model: ") and named in line, line


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("case", sorted(FOREIGN_NAMES))
def test_run_and_plan_refuse_tensor_names_of_other_methods_and_frameworks(tmp_path, case, command):
    names, named = FOREIGN_NAMES[case]
    checkpoint = _checkpoint(tmp_path / "ckpt", names=names)
    job = tmp_path / "job"
    setup_job(job, checkpoint)
    line = run_cli(job, command, "jobs.yaml")
    assert line.startswith("error: jobs.yaml: jobs.rag.model: tensor ") and named in line, line


def test_sharded_checkpoints_are_checked_from_the_index_alone(tmp_path):
    checkpoint = _checkpoint(tmp_path / "ckpt")
    (checkpoint / "model.safetensors").unlink()
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "model.layers.0.mlp.down_proj.scales": "model-00002-of-00002.safetensors"}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    job = tmp_path / "job"
    setup_job(job, checkpoint)
    assert "MLX" in run_cli(job, "plan", "jobs.yaml")
