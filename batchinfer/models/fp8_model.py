"""FP8 models without a checkpoint: random FP8 weights at preset shapes, and the dequantized twin.

`random_fp8_model` quantizes random weights (drawn on the device, `random_init`'s rules) into
the projections an FP8 checkpoint written by `checkpoint_writer` would hold FP8 — the same
`fp8_params` the loader derives from such a checkpoint. `dequantized_model` is the same
network with every FP8 weight dequantized into an unquantized `HybridModel` (the reference an
FP8 model is compared against: only the GEMM path differs).
"""
from __future__ import annotations

import torch

from batchinfer.models.checkpoint_layout import default_layout, fp8_param_names, quantized_model_tensors, writer_quantizes
from batchinfer.models.config import ModelConfig
from batchinfer.models.layers.fp8_linear import Fp8Weight
from batchinfer.models.qwen3_hybrid import HybridModel
from batchinfer.models.random_init import init_random_, make_generator
from batchinfer.kernels.fp8_gemm import block_quantize

_CHUNK_ELEMENTS = 1 << 27  # fp32 staging per quantized chunk: 512 MB


def written_fp8_params(config: ModelConfig) -> frozenset[str]:
    """The projections kept FP8 for a checkpoint our writer quantizes (Qwen's convention)."""
    tensors = quantized_model_tensors(config, default_layout(config))
    shapes = {t.name: t.shape for t in tensors}
    return fp8_param_names(tensors, lambda name: writer_quantizes(name, shapes[name]))


@torch.no_grad()
def random_fp8_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                     seed: int = 0) -> HybridModel:
    """Deterministic random weights, the projections block-quantized to FP8 on `device`."""
    model = HybridModel(config, dtype, device, written_fp8_params(config))
    generator = make_generator(seed, device)
    fp8_modules = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Weight)}
    for name, param in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner not in fp8_modules:
            init_random_(param.data, name, config.num_layers, generator)
        elif name.endswith(".weight"):
            _fill_quantized_(fp8_modules[owner], owner, config.num_layers, generator)
    return model


def _fill_quantized_(module: Fp8Weight, name: str, num_layers: int, generator: torch.Generator) -> None:
    shape = module.weight.shape
    weight, scale = module.weight.view(-1, *shape[-2:]), module.scale_inv.view(-1, *module.scale_inv.shape[-2:])
    per_chunk = max(1, _CHUNK_ELEMENTS // (shape[-2] * shape[-1]))  # leading (expert) rows per chunk
    for start in range(0, weight.shape[0], per_chunk):
        stop = min(start + per_chunk, weight.shape[0])
        staged = torch.empty((stop - start, *shape[-2:]), dtype=torch.float32, device=weight.device)
        init_random_(staged, name, num_layers, generator)
        q, s = block_quantize(staged)
        weight[start:stop].copy_(q)
        scale[start:stop].copy_(s)


@torch.no_grad()
def dequantized_model(model: HybridModel, dtype: torch.dtype) -> HybridModel:
    """An unquantized `HybridModel` in `dtype` holding `model`'s weights (FP8 ones dequantized)."""
    dense = {name: m.dequantize(dtype) for name, m in model.named_modules() if isinstance(m, Fp8Weight)}
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in dense:
            dense[name] = param
    twin = HybridModel(model.config, dtype, model.device)
    for name, param in twin.named_parameters():
        if name + "_ba" in dense:  # the quantized model's GDN in_proj is q|k|v|z, b|a apart
            param.copy_(torch.cat([dense[name], dense[name + "_ba"]]))
        else:
            param.copy_(dense[name])
    return twin
