"""The job's `model:`: resolve it to a checkpoint folder and check it before anything runs.

A bad checkpoint must fail as one line before the output folder is touched, so this
reads only small JSON files and the weights' safetensors headers (and the tokenizer later);
weights are loaded by the engine. config.json is checked here once, against the headers'
names and shapes too; a bad value is `error: <ckpt>/config.json: <key>: <what>`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from batchinfer.models.checkpoint_shapes import CheckpointError, check_against_weights, weight_shapes
from batchinfer.models.config import ModelConfig, ModelConfigError, load_model_config
from batchinfer.models.quantization import check_tensor_names, parse_quantization
from batchinfer.jobs.errors import JobError, display_path
from batchinfer.jobs.spec.job_file import DEMO_MODEL, JobSpec

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "chat_template.jinja", "model.safetensors.index.json")


def resolve_checkpoint(spec: JobSpec) -> Path:
    if spec.model == DEMO_MODEL:
        from batchinfer.demo import demo_checkpoint  # builds it once, then it is cached
        return demo_checkpoint()
    return Path(spec.model)


def check_checkpoint(checkpoint: Path, spec: JobSpec) -> ModelConfig:
    """Raise JobError unless `checkpoint` is a supported model folder (and holds the job's
    `max_model_len`); return its config."""
    def fail(what: str) -> JobError:
        return JobError(spec.job_file, spec.where("model"), what)

    def config_error(exc: ModelConfigError) -> JobError:
        if exc.key is None:
            return fail(str(exc))
        return JobError(checkpoint / "config.json", exc.key, exc.what)

    if not checkpoint.is_dir():
        raise fail(f"no such checkpoint folder: {display_path(checkpoint)}")
    try:
        config = load_model_config(checkpoint)
    except ModelConfigError as exc:
        raise config_error(exc) from None
    if not any((checkpoint / name).is_file() for name in WEIGHT_FILES):
        raise fail(f"{display_path(checkpoint)} has no safetensors weights")
    shapes = weight_shapes(checkpoint)
    if shapes is not None:  # unreadable weights are reported by the loader, naming the file
        try:
            check_tensor_names(list(shapes), parse_quantization(json.loads((checkpoint / "config.json").read_text())))
            check_against_weights(config, shapes, display_path(checkpoint))
        except ModelConfigError as exc:
            raise config_error(exc) from None
        except CheckpointError as exc:
            raise fail(str(exc)) from None
    if not (checkpoint / "tokenizer.json").is_file():
        raise fail(f"{display_path(checkpoint)} has no tokenizer.json")
    max_model_len = spec.engine.max_model_len
    # Plain RoPE only (models/config.py): positions past the trained range are not supported.
    if max_model_len is not None and max_model_len > config.max_position_embeddings:
        raise JobError(spec.job_file, spec.where("engine.max_model_len"),
                       f"must be <= the model's max_position_embeddings ({config.max_position_embeddings}), "
                       f"got {max_model_len}")
    return config


def checkpoint_fingerprint(checkpoint: Path) -> dict[str, Any]:
    """Hashes of the small files and names/sizes of the weight files (hashing GBs would be slow)."""
    small = {}
    for name in SMALL_FILES:
        path = checkpoint / name
        if path.is_file():
            small[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    weights = {p.name: p.stat().st_size for p in sorted(checkpoint.glob("*.safetensors"))}
    # The folder's location is left out: a moved or re-cached checkpoint gives the same results.
    return {"files_sha256": small, "weight_bytes": weights}
