"""Write a random-weight checkpoint with Hugging Face names (config.json + model.safetensors).

The tensor list comes from `checkpoint_layout` in the layout transformers itself writes for
the config (Qwen3-Next: fused in_proj_qkvz / in_proj_ba; experts one by one; VLM configs
under `model.language_model.`), so both our loader and transformers load the result.
Tokenizer files are not written here (the caller adds its own).

With `fp8=True` the checkpoint is FP8 block-quantized as Qwen publishes them: every 2-D
projection weight but those Qwen keeps unquantized (`checkpoint_layout.NOT_CONVERTED`) is
stored in float8_e4m3fn with a `weight_scale_inv` (fp32, one per 128 × 128 block), and
config.json gets the matching `quantization_config`. `dequantize_checkpoint` writes the
same weights back in a 16/32-bit dtype (what an FP8 model is compared against).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from batchinfer.models.checkpoint_layout import (SCALE_SUFFIX, checkpoint_tensors, default_layout, scale_name,
                                                 writer_quantizes)
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.random_init import init_random_, make_generator
from batchinfer.kernels.fp8_gemm import block_dequantize, block_quantize


def write_random_checkpoint(directory: str | Path, config_dict: Mapping[str, Any], seed: int = 0,
                            dtype: torch.dtype = torch.float32, fp8: bool = False) -> Path:
    """Write config.json and model.safetensors into `directory` (created); returns it.
    `fp8`: quantized projections (the unquantized tensors in `dtype`)."""
    directory = Path(directory)
    config = model_config_from_dict(config_dict)  # validates: unsupported configs fail here
    generator = make_generator(seed, "cpu")
    tensors: dict[str, torch.Tensor] = {}
    for spec in checkpoint_tensors(config, default_layout(config)):
        # Generated in fp32 then cast, so a checkpoint's values do not depend on its dtype.
        value = torch.empty(spec.shape, dtype=torch.float32)
        init_random_(value, spec.name, config.num_layers, generator)
        if fp8 and writer_quantizes(spec.name, spec.shape):
            tensors[spec.name], tensors[scale_name(spec.name)] = block_quantize(value)
        else:
            tensors[spec.name] = value.to(dtype).contiguous()
    config_dict = dict(config_dict)
    if fp8:
        config_dict["quantization_config"] = fp8_quantization_config(tensors)
    _save(directory, tensors, config_dict)
    return directory


def fp8_quantization_config(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Qwen's FP8 `quantization_config`, naming the 2-D weights left unquantized."""
    kept = sorted(name.removesuffix(".weight") for name, t in tensors.items()
                  if name.endswith(".weight") and t.dim() == 2 and scale_name(name) not in tensors)
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": kept}


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask only sets)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def dequantize_checkpoint(source: str | Path, directory: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write a single-file FP8 checkpoint's weights dequantized to `dtype` (no scales, no
    quantization_config) into `directory`; other tensors are cast to `dtype`."""
    source, directory = Path(source), Path(directory)
    loaded = load_file(str(source / "model.safetensors"))
    tensors = {}
    for name, value in loaded.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = loaded.get(scale_name(name))
        tensors[name] = (block_dequantize(value, scale, dtype) if scale is not None else value.to(dtype)).contiguous()
    config_dict = json.loads((source / "config.json").read_text())
    config_dict.pop("quantization_config", None)
    _save(directory, tensors, config_dict)
    return directory


def _save(directory: Path, tensors: dict[str, torch.Tensor], config_dict: Mapping[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600) and renames it: give the file
    # the mode any new file gets, so a shared or cached checkpoint is readable as its config.json is.
    os.chmod(weights, 0o666 & ~_umask())
    (directory / "config.json").write_text(json.dumps(dict(config_dict), indent=2, sort_keys=True) + "\n")
