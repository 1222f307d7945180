"""Validation of `parallel.pipeline_stages` against the model and the host, before anything loads.

More stages than the model has layers, more engines × stages than the visible GPUs, or a stage
whose weights do not fit its GPU's memory (`engine.memory_fraction` of it) are exit-2 errors
naming the key, the model's size and the memory available.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.spec.job_file import JobSpec
from batchinfer.models.config import ModelConfig
from batchinfer.models.stage_split import check_stages_fit, split_layers

_KEY = "parallel.pipeline_stages"


def check_pipeline(spec: JobSpec, config: ModelConfig, checkpoint: Path,
                   gpu_bytes: Optional[Sequence[int]] = None) -> None:
    """Raise JobError when the job's stages cannot run the model here. `gpu_bytes`: each visible
    GPU's memory (default: asked of CUDA; none on a CPU run)."""
    stages = spec.parallel.pipeline_stages
    if stages == 1:
        return
    if stages > config.num_layers:
        raise JobError(spec.job_file, spec.where(_KEY), f"must be at most the model's {config.num_layers} layers, "
                                                        f"got {stages}")
    if gpu_bytes is None:
        gpu_bytes = _visible_gpu_bytes(spec)
    if not gpu_bytes:
        return  # the CPU: every stage in this process's memory
    pinned = spec.engine.device.startswith("cuda:")
    workers = spec.parallel.workers
    engines = 1 if pinned or workers == "auto" else int(workers)
    if not pinned and engines * stages > len(gpu_bytes):
        raise JobError(spec.job_file, spec.where(_KEY), f"{engines} workers x {stages} stages need "
                                                        f"{engines * stages} GPUs, {len(gpu_bytes)} visible")
    per_stage = [int(b * spec.engine.memory_fraction) // (stages if pinned else 1) for b in gpu_bytes[:stages]]
    per_stage += [per_stage[-1]] * (stages - len(per_stage))
    split = split_layers(config, stages, weight_bytes_per_param=_bytes_per_param(checkpoint))
    try:
        check_stages_fit(split, per_stage, checkpoint.name)
    except ValueError as exc:
        raise JobError(spec.job_file, spec.where(_KEY), str(exc)) from None


def _bytes_per_param(checkpoint: Path) -> float:
    """FP8 checkpoints keep their projections in one byte on CUDA; others run in bf16."""
    try:
        raw = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return 2.0
    return 1.0 if (raw.get("quantization_config") or {}).get("quant_method") == "fp8" else 2.0


def _visible_gpu_bytes(spec: JobSpec) -> list[int]:
    if spec.engine.device == "cpu":
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    if spec.engine.device.startswith("cuda:"):
        index = int(spec.engine.device.split(":", 1)[1])
        return [torch.cuda.get_device_properties(index).total_memory]
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
