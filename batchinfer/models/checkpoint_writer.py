"""Write a random-weight checkpoint with Hugging Face names (config.json + model.safetensors).

The tensor list comes from `checkpoint_layout` in the layout transformers itself writes for
the config (Qwen3-Next: fused in_proj_qkvz / in_proj_ba; experts one by one; VLM configs
under `model.language_model.`), so both our loader and transformers load the result.
Tokenizer files are not written here (the caller adds its own).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from batchinfer.models.checkpoint_layout import checkpoint_tensors, default_layout
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.random_init import init_random_, make_generator


def write_random_checkpoint(directory: str | Path, config_dict: Mapping[str, Any], seed: int = 0,
                            dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json and model.safetensors into `directory` (created); returns it."""
    directory = Path(directory)
    config = model_config_from_dict(config_dict)  # validates: unsupported configs fail here
    generator = make_generator(seed, "cpu")
    tensors: dict[str, torch.Tensor] = {}
    for spec in checkpoint_tensors(config, default_layout(config)):
        # Generated in fp32 then cast, so a checkpoint's values do not depend on its dtype.
        value = torch.empty(spec.shape, dtype=torch.float32)
        init_random_(value, spec.name, config.num_layers, generator)
        tensors[spec.name] = value.to(dtype).contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(dict(config_dict), indent=2, sort_keys=True) + "\n")
    return directory
