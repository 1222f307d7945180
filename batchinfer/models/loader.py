"""Load a Hugging Face safetensors checkpoint into a `HybridModel`.

Files are memory-mapped (`safe_open`) and read one tensor at a time; each tensor goes straight
into its parameter (on the model's device, converted to its dtype), so peak host memory is
one tensor, not the checkpoint. Single-file (`model.safetensors`) and index-sharded
(`model.safetensors.index.json`) checkpoints both work. Vision-tower and MTP tensors are
skipped; anything else that is missing, misshapen, unexpected or unreadable raises a
`CheckpointError` naming the tensor and the file.

FP8 block-quantized checkpoints (`quantization_config.quant_method: fp8`): on CUDA the
projections whose checkpoint tensors are all FP8 stay FP8 with their scales (`Fp8Weight`,
run by the FP8 GEMM); everything else — and on the CPU every tensor — is dequantized to the
model dtype while loading, so the CPU runs the same checkpoint.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from batchinfer.models.checkpoint_layout import (IGNORED_PREFIXES, HfTensor, checkpoint_tensors, detect_layout,
                                                 fp8_param_names, quantized_model_tensors, scale_name)
from batchinfer.models.config import load_model_config
from batchinfer.models.quantization import parse_quantization
from batchinfer.models.qwen3_hybrid import HybridModel
from kernels.fp8_gemm import FP8_DTYPE, GROUP, block_dequantize, block_quantize

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint's weights do not fit the model its config.json describes."""


def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", fp8: bool | None = None) -> HybridModel:
    """Config + weights of a checkpoint directory → a ready `HybridModel` on `device`.

    `fp8`: keep an FP8 checkpoint's projections FP8 (default: on CUDA only); False dequantizes."""
    config = load_model_config(path)
    model = HybridModel(config, dtype, device, _fp8_params(path, config, torch.device(device), fp8))
    load_weights(model, path)
    return model


def _fp8_params(path: str | Path, config, device: torch.device, fp8: bool | None) -> frozenset[str] | None:
    """The projections to keep FP8 (None: an unquantized model, FP8 tensors dequantized)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    if parse_quantization(raw) is None or not (device.type == "cuda" if fp8 is None else fp8):
        return None
    files = tensor_files(path)
    tensors = quantized_model_tensors(config, detect_layout(config, files.keys()))
    return fp8_param_names(tensors, lambda name: scale_name(name) in files)


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
    quantized_model = model.fp8_params is not None
    wanted = (quantized_model_tensors if quantized_model else checkpoint_tensors)(model.config, layout)
    scaled = {t.name for t in wanted if scale_name(t.name) in files}  # FP8 tensors of the checkpoint
    _reject_unexpected(files, {t.name for t in wanted} | {scale_name(n) for n in scaled}, layout.prefix)

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
                scale = _read_scale(files, spec, value, f, file) if spec.name in scaled else None
                if value.dtype == FP8_DTYPE and scale is None:
                    raise CheckpointError(f"FP8 tensor {spec.name!r} in {file.name} has no {scale_name(spec.name)!r}")
                if spec.targets[0].param + ".weight" in params:  # an Fp8Weight of the model
                    _fill_fp8(params, filled, spec, value, scale, model.device)
                    continue
                if scale is not None:
                    value = block_dequantize(value.to(model.device), scale.to(model.device), torch.float32)
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


def _read_scale(files: dict[str, Path], spec: HfTensor, value: torch.Tensor, f, file: Path) -> torch.Tensor:
    """The fp32 block scales of an FP8 `spec` (from its own file when the shards split them)."""
    name = scale_name(spec.name)
    expected = (-(-value.shape[-2] // GROUP), -(-value.shape[-1] // GROUP))
    if files[name] == file:
        scale = _read(f, HfTensor(name, expected, ()), file)
    else:
        with _open(files[name], first_tensor=name) as other:
            scale = _read(other, HfTensor(name, expected, ()), files[name])
    if value.dtype != FP8_DTYPE:
        raise CheckpointError(f"tensor {spec.name!r} has {name!r} but dtype {value.dtype}, not float8_e4m3fn")
    return scale.float()


def _fill_fp8(params: dict, filled: dict, spec: HfTensor, value: torch.Tensor, scale: torch.Tensor | None,
              device: torch.device) -> None:
    """Copy one checkpoint tensor into FP8 weights + scales (quantized here if it is not FP8)."""
    if scale is None:
        value, scale = block_quantize(value.to(device))
    pieces = spec.split(value) if spec.split else (value,)
    scale_pieces = _split_scales(spec, scale, value.shape[-2])
    for target, piece, scale_piece in zip(spec.targets, pieces, scale_pieces):
        weight, scale_inv = target.param + ".weight", target.param + ".scale_inv"
        params[weight][target.index].copy_(piece)
        params[scale_inv][_scale_index(spec, target.index, params[weight].dim())].copy_(scale_piece)
        filled[weight] += piece.numel()
        filled[scale_inv] += scale_piece.numel()


def _split_scales(spec: HfTensor, scale: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """The scale rows of each piece `spec.split` cuts: the split applied to the scales
    expanded to one row per weight row, then one row per block taken back — valid only when
    no piece starts inside a block, which is checked."""
    if not spec.split:
        return (scale,)
    pieces = []
    for piece in spec.split(scale.repeat_interleave(GROUP, dim=-2)[..., :rows, :]):
        blocks = piece[..., ::GROUP, :]
        if not torch.equal(blocks.repeat_interleave(GROUP, dim=-2)[..., :piece.shape[-2], :], piece):
            raise CheckpointError(f"FP8 tensor {spec.name!r}: a fused part is not aligned to 128-row blocks")
        pieces.append(blocks)
    return tuple(pieces)


def _scale_index(spec: HfTensor, index: tuple, ndim: int) -> tuple:
    """A weight index's rows (dim -2) in block units."""
    position = ndim - 2
    if len(index) <= position or not isinstance(index[position], slice):
        return index
    rows = index[position]
    if rows.start % GROUP:
        raise CheckpointError(f"FP8 tensor {spec.name!r}: its rows start inside a 128-row block of the fused weight")
    return (*index[:position], slice(rows.start // GROUP, -(-rows.stop // GROUP)), *index[position + 1:])


def _reject_unexpected(files: dict[str, Path], wanted: set[str], prefix: str) -> None:
    """A text-model tensor we would not load means the model would silently run without it."""
    for name, file in files.items():
        in_text_model = name.startswith(prefix) or name == "lm_head.weight"
        if not in_text_model or name in wanted or name.startswith(IGNORED_PREFIXES):
            continue
        if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
            continue  # a tied head saved anyway; a recomputable buffer
        raise CheckpointError(f"unexpected tensor {name!r} in {file.name}: not part of this model's layout")
