"""Where each local worker runs: its GPU (through CUDA_VISIBLE_DEVICES) or its share of the CPU cores.

Workers are spread over the visible GPUs round-robin; workers that share one GPU (e.g. `workers: 2`
on one GPU, to test the multi-process path) split the memory budget between them. On the CPU each
worker gets cores // N torch threads, so N engines do not oversubscribe the cores.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

MEMORY_FRACTION_KEY = "engine.memory_fraction"


@dataclass(frozen=True)
class Placement:
    worker: int
    device: str                                  # what UnitWorker.open receives: "cuda:0" or "cpu"
    env: Mapping[str, str] = field(default_factory=dict)        # set in the worker's environment
    torch_threads: Optional[int] = None
    overrides: Mapping[str, Any] = field(default_factory=dict)  # added to the worker's recipe


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES entries (ids or UUIDs); [] without CUDA."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()]
    try:
        import torch
    except ImportError:
        return []
    return [str(index) for index in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_workers(workers: Union[int, str], device: str, gpu_count: int) -> int:
    """`auto`: one worker per visible GPU, or 1 on the CPU."""
    if workers == "auto":
        return max(gpu_count, 1) if device == "cuda" else 1
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be 'auto' or a positive integer, not {workers!r}")
    return workers


def local_placements(workers: int, device: str, gpus: Sequence[str] = (), cores: int = 1,
                     memory_fraction: float = 0.9, gpus_per_worker: int = 1) -> list[Placement]:
    """One placement per worker; `device` is "cuda" or "cpu". `gpus_per_worker` > 1 (pipeline
    stages): each worker sees its own run of that many GPUs, stage s on its cuda:s."""
    if device == "cpu":
        threads = max(cores // workers, 1)
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
        return [Placement(worker=index, device="cpu", env=env, torch_threads=threads) for index in range(workers)]
    if device != "cuda":
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
    if not gpus:
        raise ValueError("no visible GPU for the CUDA workers")
    if gpus_per_worker > 1:
        if workers * gpus_per_worker > len(gpus):
            raise ValueError(f"{workers} workers x {gpus_per_worker} pipeline stages need "
                             f"{workers * gpus_per_worker} GPUs, {len(gpus)} visible")
        # A worker is one engine on its GPUs: its own validation counts itself alone.
        return [Placement(worker=index, device="cuda", env={"CUDA_VISIBLE_DEVICES": ",".join(
            gpus[index * gpus_per_worker:(index + 1) * gpus_per_worker])}, overrides={"parallel.workers": 1})
            for index in range(workers)]
    chosen = [gpus[index % len(gpus)] for index in range(workers)]
    sharers = Counter(chosen)
    return [Placement(worker=index, device="cuda:0", env={"CUDA_VISIBLE_DEVICES": gpu},
                      overrides={MEMORY_FRACTION_KEY: memory_fraction / sharers[gpu]} if sharers[gpu] > 1 else {})
            for index, gpu in enumerate(chosen)]
