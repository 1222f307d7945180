"""A checkpoint's config.json checked against its weights' names and shapes, before anything is allocated.

Names come from the safetensors index (or the single file's header), shapes from each file's
header: no tensor data is read. A config whose layer count, expert count or sizes do not match
the tensors is refused here, in one line, instead of allocating a model of the config's size
first (`num_hidden_layers: 1000000` allocated for minutes) and failing when the weights load.
The job's checks (`jobs/spec/checkpoint.py`) and `loader.empty_model` both run it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from safetensors import safe_open

from batchinfer.models.checkpoint_layout import IGNORED_PREFIXES, checkpoint_tensors, detect_layout, scale_name
from batchinfer.models.config import ModelConfig, ModelConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

Shape = tuple[int, ...]


class CheckpointError(ValueError):
    """The checkpoint's weights do not fit the model its config.json describes."""


def weight_shapes(path: str | Path) -> Optional[dict[str, tuple[str, Optional[Shape]]]]:
    """name → (file name, shape) of every tensor; the shape is None where its file's header cannot
    be read (a missing or partly downloaded shard). None when not even the names can be read:
    the loader reports that when it opens the files."""
    path = Path(path)
    try:
        if (path / INDEX_FILE).is_file():
            files = {name: str(file) for name, file in
                     json.loads((path / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"].items()}
        else:
            files = {name: SINGLE_FILE for name in _header_shapes(path / SINGLE_FILE)}
    except Exception:  # a malformed index or header: safetensors raises its own error types
        return None
    shapes: dict[str, Shape] = {}
    for file in sorted(set(files.values())):
        try:
            shapes.update(_header_shapes(path / file))
        except Exception:
            continue
    return {name: (file, shapes.get(name)) for name, file in files.items()}


def _header_shapes(file: Path) -> dict[str, Shape]:
    with safe_open(str(file), framework="pt") as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def check_against_weights(config: ModelConfig, tensors: dict[str, tuple[str, Optional[Shape]]],
                          checkpoint: str | Path) -> None:
    """Raise ModelConfigError (naming the config.json key) when the config's layer or expert count
    does not match the tensors, else CheckpointError for a missing, misshapen or unexpected tensor."""
    layout = detect_layout(config, tensors.keys())
    key_prefix = "text_config." if config.is_vlm_checkpoint else ""
    layer_name = re.compile(re.escape(layout.prefix) + r"layers\.([0-9]+)\.")
    layers = {int(m.group(1)) for m in map(layer_name.match, tensors) if m}
    if layers != set(range(config.num_layers)):  # counted first: the expected list below grows with it
        held = f"{len(layers)} layers" + (f" ({layout.prefix}layers.{min(layers)}-{max(layers)})" if layers else "")
        raise ModelConfigError(f"is {config.num_layers}, but the checkpoint's tensors hold {held}",
                               key=key_prefix + "num_hidden_layers")
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    if moe_layers and not layout.stacked_experts:
        expert = re.compile(re.escape(f"{layout.prefix}layers.{moe_layers[0]}.mlp.experts.") + r"([0-9]+)\.")
        experts = {int(m.group(1)) for m in map(expert.match, tensors) if m}
        if experts and experts != set(range(config.num_experts)):
            raise ModelConfigError(f"is {config.num_experts}, but layer {moe_layers[0]} of the checkpoint holds "
                                   f"{len(experts)} experts", key=key_prefix + "num_experts")
    wanted = checkpoint_tensors(config, layout)
    for spec in wanted:
        if spec.name not in tensors:
            raise CheckpointError(f"tensor {spec.name!r} is missing from checkpoint {checkpoint}")
        file, shape = tensors[spec.name]
        if shape is not None and shape != spec.shape:
            raise CheckpointError(f"tensor {spec.name!r} in {Path(file).name} has shape {list(shape)}, "
                                  f"expected {list(spec.shape)} (from config.json)")
    names = {spec.name for spec in wanted}
    reject_unexpected({name: file for name, (file, _) in tensors.items()},
                      names | {scale_name(name) for name in names}, layout.prefix)


def reject_unexpected(files: dict[str, str | Path], wanted: set[str], prefix: str) -> None:
    """A text-model tensor we would not load means the model would silently run without it."""
    for name, file in files.items():
        in_text_model = name.startswith(prefix) or name == "lm_head.weight"
        if not in_text_model or name in wanted or name.startswith(IGNORED_PREFIXES):
            continue
        if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
            continue  # a tied head saved anyway; a recomputable buffer
        raise CheckpointError(f"unexpected tensor {name!r} in {Path(file).name}: not part of this model's layout")
