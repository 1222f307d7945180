"""Building a `PipelinedModel`: stage devices, the layer split, empty stages, their weights.

`stage_devices`: `cpu` puts every stage on the CPU (the tests' path: the same code in order);
`cuda` / `auto` puts stage s on `cuda:s` of the visible GPUs (a worker's GPUs); `cuda:K` puts
every stage on GPU K (a pipeline measured on one GPU). From a checkpoint each stage is
allocated empty and `load_stage_weights` fills it reading only its tensors; a preset draws the
same random weights as the whole model would (same names, same order, one generator on the
first stage's device), each copied to the stage that holds it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from batchinfer.models.checkpoint_shapes import check_against_weights, weight_shapes
from batchinfer.models.config import ModelConfig, load_model_config
from batchinfer.models.loader import fp8_params_for, load_weights
from batchinfer.models.pipeline import PipelinedModel, StageModel
from batchinfer.models.qwen3_hybrid import HybridModel
from batchinfer.models.random_init import init_random_, make_generator
from batchinfer.models.stage_split import StageSplit, split_layers


def stage_devices(device: torch.device, num_stages: int) -> list[torch.device]:
    """Where each stage runs (see the module docstring); raises ValueError when a plain `cuda`
    device has fewer visible GPUs than stages."""
    if device.type != "cuda":
        return [device] * num_stages
    if device.index is not None:
        return [device] * num_stages
    visible = torch.cuda.device_count()
    if visible < num_stages:
        raise ValueError(f"pipeline_stages: {num_stages} stages need {num_stages} GPUs, {visible} visible")
    return [torch.device("cuda", s) for s in range(num_stages)]


def model_split(config: ModelConfig, num_stages: int, dtype: torch.dtype) -> StageSplit:
    return split_layers(config, num_stages, weight_bytes_per_param=torch.empty((), dtype=dtype).element_size())


def empty_stages(config: ModelConfig, split: StageSplit, dtype: torch.dtype, devices: list[torch.device],
                 fp8_params: Optional[frozenset[str]] = None, micro_batches: Optional[int] = None) -> PipelinedModel:
    stages = [StageModel(config, split.layers(s), dtype, devices[s], fp8_params) for s in range(split.num_stages)]
    return PipelinedModel(stages, split, micro_batches)


def empty_pipelined_model(path: str | Path, dtype: torch.dtype, devices: list[torch.device],
                          fp8: Optional[bool] = None) -> PipelinedModel:
    """A checkpoint's stages allocated, not filled (config checked against the headers first)."""
    config = load_model_config(path)
    shapes = weight_shapes(path)
    if shapes is not None:
        check_against_weights(config, shapes, path)
    fp8_params = fp8_params_for(path, config, devices[0], fp8)
    return empty_stages(config, model_split(config, len(devices), dtype), dtype, devices, fp8_params)


def load_stage_weights(model: PipelinedModel, path: str | Path) -> None:
    """Each stage reads only its own tensors from the checkpoint's safetensors files."""
    for stage in model.stages:
        load_weights(stage, path)


@torch.no_grad()
def random_pipelined_model(config: ModelConfig, dtype: torch.dtype, devices: list[torch.device],
                           seed: int = 0) -> PipelinedModel:
    """The weights `presets.random_model` draws for the whole model, split over the stages."""
    model = empty_stages(config, model_split(config, len(devices), dtype), dtype, devices)
    holders: dict[str, list[torch.Tensor]] = {}
    for stage in model.stages:
        for name, param in stage.named_parameters():
            holders.setdefault(name, []).append(param.data)
    generator = make_generator(seed, devices[0])
    whole = HybridModel(config, dtype, "meta")  # names and order only
    for name, meta in whole.named_parameters():
        targets = holders[name]
        drawn = targets[0] if targets[0].device == devices[0] else torch.empty(meta.shape, dtype=dtype,
                                                                              device=devices[0])
        init_random_(drawn, name, config.num_layers, generator)
        for target in targets:
            if target is not drawn:
                target.copy_(drawn)
    return model



def pipelined_model(model: str, dtype: torch.dtype, device: torch.device, num_stages: int, seed: int = 0):
    """(the `PipelinedModel` of a preset name or checkpoint directory, the weight fill still to
    run or None): a preset's weights are drawn at once, a checkpoint's stages only allocated."""
    from batchinfer.models.presets import PRESETS, preset_config

    devices = stage_devices(device, num_stages)
    if model in PRESETS:
        if "quantization_config" in PRESETS[model]:
            raise ValueError(f"{model}: FP8 presets are not drawn as pipeline stages yet; "
                             f"run an FP8 checkpoint (written by checkpoint_writer) instead")
        built = random_pipelined_model(preset_config(model), dtype, devices, seed)
        return built, None
    built = empty_pipelined_model(model, dtype, devices)

    def fill() -> None:
        load_stage_weights(built, model)
        for d in set(devices):
            if d.type == "cuda":
                torch.cuda.synchronize(d)  # the copies to the devices are part of the load

    return built, fill
