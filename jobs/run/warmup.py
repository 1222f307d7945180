"""`batchinfer warmup jobs.yaml`: fill the Triton compile cache for the jobs' engines ahead of time.

For each distinct (checkpoint config, engine settings) among the selected jobs, an engine is
built around a model with *uninitialised* weights of the checkpoint's shapes — no weight file is
read: kernels see shapes, never values — so its start-up precompile (batchinfer.engine.precompile)
and decode-graph capture compile everything into TRITON_CACHE_DIR. Run it once on a machine image
(or at a job's start, beside the weight download) and the jobs' first run starts warm. Inputs are
not read. On the CPU there is nothing to compile.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from batchinfer.jobs.spec.checkpoint import check_checkpoint, resolve_checkpoint
from batchinfer.jobs.spec.job_file import JobSpec, engine_config_kwargs


@dataclass(frozen=True)
class WarmupResult:
    jobs: tuple[str, ...]        # the jobs this engine serves
    device: str
    kernels: int                 # Triton specialisations traced (0: nothing to compile, e.g. CPU)
    compiled: int                # of them compiled now (the rest were in the cache already)
    seconds: float


def warm_up(specs: Sequence[JobSpec], echo: Callable[[str], None] = print) -> list[WarmupResult]:
    """Build one engine per distinct (model config, engine settings); JobError on a bad checkpoint."""
    import torch

    from batchinfer.engine import Engine, EngineConfig
    from batchinfer.models.config import load_model_config
    from batchinfer.models.qwen3_hybrid import HybridModel

    groups: dict[str, list[JobSpec]] = {}
    for spec in specs:
        checkpoint = resolve_checkpoint(spec)
        check_checkpoint(checkpoint, spec)
        key = json.dumps([(checkpoint / "config.json").read_text(), engine_config_kwargs(spec.engine)],
                         sort_keys=True, default=str)
        groups.setdefault(key, []).append(spec)
    results = []
    for group in groups.values():
        spec = group[0]
        config = EngineConfig(**engine_config_kwargs(spec.engine))
        device = config.resolved_device()
        names = tuple(s.name for s in group)
        if device.type != "cuda":
            echo(f"warmup {', '.join(names)}: {device} needs no kernel compiles")
            results.append(WarmupResult(names, str(device), 0, 0, 0.0))
            continue
        start = time.monotonic()
        model = HybridModel(load_model_config(resolve_checkpoint(spec)), config.resolved_dtype(), device)
        engine = Engine(model, config, model_name=spec.model)
        report = engine.precompile_report
        kernels, compiled = (report.kernels, report.compiled) if report is not None else (0, 0)
        seconds = time.monotonic() - start
        echo(f"warmup {', '.join(names)}: {kernels} Triton kernels, {compiled} compiled now, "
             f"decode graphs captured, {seconds:.1f} s")
        results.append(WarmupResult(names, str(device), kernels, compiled, seconds))
        del engine, model
        torch.cuda.empty_cache()
    return results


def warm_up_job_file(job_file, job_name: Optional[str], echo: Callable[[str], None] = print) -> list[WarmupResult]:
    from batchinfer.jobs.spec.job_file import load_job_file

    return warm_up(load_job_file(job_file).select(job_name), echo)
