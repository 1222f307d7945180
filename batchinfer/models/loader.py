"""Load a Hugging Face safetensors checkpoint into a `HybridModel`.

Files are memory-mapped (`safe_open`) and read one tensor at a time; each tensor goes straight
into its parameter (on the model's device, converted to its dtype), so peak host memory is
one tensor, not the checkpoint. Single-file (`model.safetensors`) and index-sharded
(`model.safetensors.index.json`) checkpoints both work. Vision-tower and MTP tensors are
skipped; anything else that is missing, misshapen, unexpected or unreadable raises a
`CheckpointError` naming the tensor and the file.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from batchinfer.models.checkpoint_layout import IGNORED_PREFIXES, HfTensor, checkpoint_tensors, detect_layout
from batchinfer.models.config import load_model_config
from batchinfer.models.qwen3_hybrid import HybridModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint's weights do not fit the model its config.json describes."""


def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu") -> HybridModel:
    """Config + weights of a checkpoint directory → a ready `HybridModel` on `device`."""
    model = HybridModel(load_model_config(path), dtype, device)
    load_weights(model, path)
    return model


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Where each tensor of a checkpoint directory lives: name → safetensors file."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index: {err}") from None
        return {name: path / file for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    with _open(single, first_tensor=None) as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_weights(model: HybridModel, path: str | Path) -> None:
    """Fill every parameter of `model` from the checkpoint at `path` (streamed, in place)."""
    files = tensor_files(path)
    layout = detect_layout(model.config, files.keys())
    wanted = checkpoint_tensors(model.config, layout)
    _reject_unexpected(files, {t.name for t in wanted}, layout.prefix)

    by_file: dict[Path, list[HfTensor]] = defaultdict(list)
    for tensor in wanted:
        if tensor.name not in files:
            raise CheckpointError(f"tensor {tensor.name!r} is missing from checkpoint {path}")
        by_file[files[tensor.name]].append(tensor)

    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)  # elements written per parameter, to prove full coverage
    for file, tensors in by_file.items():
        if not file.exists():
            raise CheckpointError(f"file {file.name} (holding {tensors[0].name!r}) is missing from {path}")
        with _open(file, first_tensor=tensors[0].name) as f:
            for spec in tensors:
                value = _read(f, spec, file)
                pieces = spec.split(value) if spec.split else (value,)
                for target, piece in zip(spec.targets, pieces):
                    params[target.param][target.index].copy_(piece)
                    filled[target.param] += piece.numel()

    unfilled = [name for name, p in params.items() if filled[name] != p.numel()]
    if unfilled:  # a layout bug, not a user error: the tensor list does not cover the model
        raise CheckpointError(f"checkpoint {path} left parameters unset: {', '.join(unfilled[:5])}")


def _open(file: Path, first_tensor: str | None):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error type for corrupt headers
        what = f" (holding {first_tensor!r})" if first_tensor else ""
        raise CheckpointError(f"cannot read {file.name}{what}: {err} — truncated or not safetensors?") from None


def _read(f, spec: HfTensor, file: Path) -> torch.Tensor:
    try:
        value = f.get_tensor(spec.name)
    except Exception as err:
        raise CheckpointError(f"cannot read tensor {spec.name!r} from {file.name}: {err}") from None
    if tuple(value.shape) != spec.shape:
        raise CheckpointError(
            f"tensor {spec.name!r} in {file.name} has shape {list(value.shape)}, expected {list(spec.shape)}")
    return value


def _reject_unexpected(files: dict[str, Path], wanted: set[str], prefix: str) -> None:
    """A text-model tensor we would not load means the model would silently run without it."""
    for name, file in files.items():
        in_text_model = name.startswith(prefix) or name == "lm_head.weight"
        if not in_text_model or name in wanted or name.startswith(IGNORED_PREFIXES):
            continue
        if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
            continue  # a tied head saved anyway; a recomputable buffer
        raise CheckpointError(f"unexpected tensor {name!r} in {file.name}: not part of this model's layout")
