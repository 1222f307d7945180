"""The GDN-hybrid model: config, checkpoint loading, presets, and the packed-batch forward."""
from batchinfer.models.checkpoint_writer import write_random_checkpoint
from batchinfer.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelConfigError,
    load_model_config,
    model_config_from_dict,
)
from batchinfer.models.forward_batch import ForwardBatch, ModelCaches, allocate_caches
from batchinfer.models.loader import CheckpointError, load_model, load_weights
from batchinfer.models.presets import PRESETS, build_model, preset_config, random_model
from batchinfer.models.qwen3_hybrid import HybridModel

__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "ForwardBatch",
    "HybridModel",
    "ModelCaches",
    "ModelConfig",
    "ModelConfigError",
    "allocate_caches",
    "build_model",
    "load_model",
    "load_model_config",
    "load_weights",
    "model_config_from_dict",
    "preset_config",
    "random_model",
    "write_random_checkpoint",
]
