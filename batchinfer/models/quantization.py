"""Which quantized checkpoints the engine can run, decided from config.json and tensor names alone.

The engine runs unquantized weights and FP8 block quantization (e4m3 weights in 128×128 blocks
with `weight_scale_inv`, activations quantized dynamically), the format Qwen publishes its FP8
checkpoints in. Anything else — AWQ, GPTQ, bitsandbytes, compressed-tensors, MXFP4, other FP8
layouts, or an MLX / GGUF-style conversion — would fail deep in the loader (or, worse, load
into the wrong places), so it is refused here with one line naming the method, before a job
writes anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

from batchinfer.models.config import ModelConfigError


@dataclass(frozen=True)
class Fp8BlockQuant:
    """FP8 e4m3 weights with one float scale (`weight_scale_inv`) per `block` of the weight."""

    block: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()  # name fragments of modules kept unquantized


SUPPORTED = "unquantized weights or fp8 (e4m3, weight_block_size [128, 128], dynamic activations)"

# Tensor-name endings that only quantized formats of other methods or frameworks write.
_FOREIGN_SUFFIXES = {
    ".scales": "MLX or GPTQ/AWQ quantized weights (`.scales`)",
    ".biases": "MLX quantized weights (`.biases`)",
    ".qweight": "GPTQ/AWQ quantized weights (`.qweight`)",
    ".qzeros": "GPTQ/AWQ quantized weights (`.qzeros`)",
    ".g_idx": "GPTQ quantized weights (`.g_idx`)",
    ".absmax": "bitsandbytes quantized weights (`.absmax`)",
    ".quant_map": "bitsandbytes quantized weights (`.quant_map`)",
    ".SCB": "bitsandbytes int8 weights (`.SCB`)",
    ".weight_packed": "compressed-tensors packed weights (`.weight_packed`)",
    "_blocks": "MXFP4 weights (`_blocks`)",
}
_FP8_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
# Hugging Face names every tensor of these families under one of these roots.
_HF_ROOTS = ("model.", "lm_head.", "mtp.", "visual.")


def _quantization_section(raw_config: Mapping[str, Any]) -> tuple[Optional[Any], str]:
    """(the quantization settings, the key they were found under), top level before text_config."""
    text = raw_config.get("text_config")
    sources = [(raw_config, "quantization_config")]
    if isinstance(text, Mapping):
        sources.append((text, "text_config.quantization_config"))
    for source, where in sources:
        if source.get("quantization_config") is not None:
            return source["quantization_config"], where
    # MLX writes its own `quantization` block (bits, group_size) and no quant_method.
    if raw_config.get("quantization") is not None:
        return raw_config["quantization"], "quantization"
    return None, ""


def parse_quantization(raw_config: Mapping[str, Any]) -> Optional[Fp8BlockQuant]:
    """The checkpoint's quantization from its parsed config.json: None (unquantized), an
    `Fp8BlockQuant`, or a one-line `ModelConfigError` naming what is not supported."""
    section, where = _quantization_section(raw_config)
    if section is None:
        return None
    if where == "quantization":
        shown = ", ".join(f"{k} {section[k]}" for k in ("bits", "group_size") if isinstance(section, Mapping)
                          and k in section)
        raise ModelConfigError(f"{where}: MLX quantization ({shown or repr(section)}) is not supported; "
                               f"this engine runs {SUPPORTED}")
    if not isinstance(section, Mapping):
        raise ModelConfigError(f"{where}: must be a mapping, got {type(section).__name__}")
    method = section.get("quant_method")
    if method is None:
        raise ModelConfigError(f"{where}: has no quant_method; this engine runs {SUPPORTED}")
    if str(method).lower() != "fp8":
        raise ModelConfigError(f"{where}: quant_method {method!r} is not supported; this engine runs {SUPPORTED}")
    block = section.get("weight_block_size")
    wrong = []
    if section.get("fmt", "e4m3") != "e4m3":
        wrong.append(f"fmt {section['fmt']!r}")
    if section.get("activation_scheme", "dynamic") != "dynamic":
        wrong.append(f"activation_scheme {section['activation_scheme']!r}")
    if block is None:
        wrong.append("no weight_block_size (per-tensor scales)")
    elif list(block) != [128, 128]:
        wrong.append(f"weight_block_size {list(block)}")
    if wrong:
        raise ModelConfigError(f"{where}: fp8 with {', '.join(wrong)} is not supported; this engine runs {SUPPORTED}")
    skipped = section.get("modules_to_not_convert") or ()
    if isinstance(skipped, str) or not all(isinstance(name, str) for name in skipped):
        raise ModelConfigError(f"{where}: modules_to_not_convert must be a list of module names")
    return Fp8BlockQuant(block=(128, 128), modules_to_not_convert=tuple(skipped))


def check_tensor_names(names: Collection[str], quantization: Optional[Fp8BlockQuant]) -> None:
    """Refuse a checkpoint whose tensor names (from the safetensors index or headers) belong to
    another quantization method or framework than its config.json says."""
    for name in sorted(names):
        for suffix, what in _FOREIGN_SUFFIXES.items():
            if name.endswith(suffix):
                raise ModelConfigError(f"tensor {name!r}: {what} are not supported; this engine runs {SUPPORTED}")
        if quantization is None and name.endswith(_FP8_SCALE_SUFFIXES):
            raise ModelConfigError(f"tensor {name!r}: quantization scales, but config.json has no "
                                   f"quantization_config; this engine runs {SUPPORTED}")
        if not name.startswith(_HF_ROOTS):
            raise ModelConfigError(f"tensor {name!r}: not a Hugging Face transformers tensor name (a conversion "
                                   f"for another framework, such as MLX?); expected names under "
                                   f"{', '.join(repr(root) for root in _HF_ROOTS)}")
