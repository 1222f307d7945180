"""Load a Hugging Face safetensors checkpoint into a `HybridModel`.

Onto a CUDA model, each file is read in large sequential reads (256 MiB) into two alternating
pinned buffers and copied to the device asynchronously, so the disk read of one batch overlaps
the copies of the last (a tensor read through an mmap page by page, then copied from pageable
memory, reaches neither rate). Onto the CPU, files are memory-mapped (`safe_open`) and read one
tensor at a time. Either way each tensor goes straight into its parameter (converted to its
dtype), so peak host memory is a buffer or one tensor, not the checkpoint. Single-file
(`model.safetensors`) and index-sharded (`model.safetensors.index.json`) checkpoints both work. Vision-tower and MTP tensors are
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
from typing import Iterator, Optional

import torch
from safetensors import safe_open

from batchinfer.models.checkpoint_layout import (HfTensor, checkpoint_tensors, detect_layout, fp8_param_names,
                                                 quantized_model_tensors, scale_name)
from batchinfer.models.checkpoint_shapes import (INDEX_FILE, SINGLE_FILE, CheckpointError, check_against_weights,
                                                 reject_unexpected, weight_shapes)
from batchinfer.models.config import load_model_config
from batchinfer.models.quantization import parse_quantization
from batchinfer.models.qwen3_hybrid import HybridModel
from batchinfer.kernels.fp8_gemm import FP8_DTYPE, GROUP, block_dequantize, block_quantize



def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", fp8: bool | None = None) -> HybridModel:
    """Config + weights of a checkpoint directory → a ready `HybridModel` on `device`.

    `fp8`: keep an FP8 checkpoint's projections FP8 (default: on CUDA only); False dequantizes."""
    model = empty_model(path, dtype, device, fp8)
    load_weights(model, path)
    return model


def empty_model(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu", fp8: bool | None = None) -> HybridModel:
    """The checkpoint's `HybridModel` with its parameters allocated but not filled (`load_weights`
    fills them): what runs on shapes alone (the kernel trace) can start before the weights load.
    The config is checked against the weights' headers first, so a wrong one allocates nothing."""
    config = load_model_config(path)
    shapes = weight_shapes(path)
    if shapes is not None:  # unreadable files are reported by load_weights, naming them
        check_against_weights(config, shapes, path)
    return HybridModel(config, dtype, device, fp8_params_for(path, config, torch.device(device), fp8))


def fp8_params_for(path: str | Path, config, device: torch.device, fp8: bool | None) -> frozenset[str] | None:
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
def load_weights(model: HybridModel, path: str | Path, streamed: bool = False) -> None:
    """Fill every parameter of `model` from the checkpoint at `path` (in place). `model` may be a
    pipeline stage (`pipeline.StageModel`): only the tensors of its parameters are read.

    By default tensors are read one at a time from the memory-mapped file: on the H200 that is at
    disk speed from a cold page cache and 2.5x faster than `streamed` from a warm one
    (docs/BENCHMARKS.md, "Cold start and weight loading"). `streamed=True` reads each file in
    large sequential reads into pinned buffers with asynchronous copies to the device (9% faster
    cold, slower warm)."""
    files = tensor_files(path)
    layout = detect_layout(model.config, files.keys())
    quantized_model = model.fp8_params is not None
    wanted = (quantized_model_tensors if quantized_model else checkpoint_tensors)(model.config, layout)
    scaled = {t.name for t in wanted if scale_name(t.name) in files}  # FP8 tensors of the checkpoint
    reject_unexpected(files, {t.name for t in wanted} | {scale_name(n) for n in scaled}, layout.prefix)
    params = dict(model.named_parameters())
    # A pipeline stage holds some of the model's parameters: it reads only the tensors that fill them.
    wanted = [t for t in wanted if any(p.param in params or p.param + ".weight" in params for p in t.targets)]

    by_file: dict[Path, list[HfTensor]] = defaultdict(list)
    for tensor in wanted:
        if tensor.name not in files:
            raise CheckpointError(f"tensor {tensor.name!r} is missing from checkpoint {path}")
        by_file[files[tensor.name]].append(tensor)

    filled = dict.fromkeys(params, 0)  # elements written per parameter, to prove full coverage
    streamed = bool(streamed) and not scaled  # FP8 weights are read with their scales, one at a time
    for file, tensors in by_file.items():
        if not file.exists():
            raise CheckpointError(f"file {file.name} (holding {tensors[0].name!r}) is missing from {path}")
        if scaled:
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
            continue
        values = _streamed_tensors(file, tensors) if streamed else _mapped_tensors(file, tensors)
        for spec, value in values:
            pieces = spec.split(value) if spec.split else (value,)
            for target, piece in zip(spec.targets, pieces):
                # From pinned staging (streamed) the copy is asynchronous; the buffer is not
                # reused before the copies that read it are done (_streamed_tensors).
                params[target.param][target.index].copy_(piece, non_blocking=streamed)
                filled[target.param] += piece.numel()
    if streamed and torch.cuda.is_available():
        torch.cuda.synchronize()

    unfilled = [name for name, p in params.items() if filled[name] != p.numel()]
    if unfilled:  # a layout bug, not a user error: the tensor list does not cover the model
        raise CheckpointError(f"checkpoint {path} left parameters unset: {', '.join(unfilled[:5])}")


def _mapped_tensors(file: Path, tensors: list[HfTensor]) -> Iterator[tuple[HfTensor, torch.Tensor]]:
    with _open(file, first_tensor=tensors[0].name) as f:
        for spec in tensors:
            yield spec, _read(f, spec, file)


STAGING_BYTES = 256 << 20  # one read; two such pinned buffers alternate (read one while the other copies)
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _header(file: Path, first_tensor: str) -> tuple[dict, int]:
    """A safetensors file's header (name → dtype, shape, data_offsets) and where its data starts."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        return header, 8 + size
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {file.name} (holding {first_tensor!r}): {err} — "
                              "truncated or not safetensors?") from None


def _streamed_tensors(file: Path, tensors: list[HfTensor]) -> Iterator[tuple[HfTensor, torch.Tensor]]:
    """The tensors of one file from large sequential reads into pinned buffers (in file order).

    Each yielded tensor is a view of a staging buffer; it must be consumed (copied) before the
    next batch is read — the caller's copies are recorded on an event that the buffer waits on
    before it is refilled."""
    header, data_start = _header(file, tensors[0].name)
    entries = []
    file_size = file.stat().st_size
    for spec in tensors:
        info = header.get(spec.name)
        if info is None or info.get("dtype") not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"cannot read tensor {spec.name!r} from {file.name}: "
                                  f"{'not in its header' if info is None else 'dtype ' + repr(info.get('dtype'))}")
        begin, end = (data_start + offset for offset in info["data_offsets"])
        if tuple(info["shape"]) != spec.shape:
            raise CheckpointError(f"tensor {spec.name!r} in {file.name} has shape {list(info['shape'])}, "
                                  f"expected {list(spec.shape)}")
        if end > file_size:
            raise CheckpointError(f"cannot read tensor {spec.name!r} from {file.name}: the file ends at byte "
                                  f"{file_size}, the tensor at {end} — truncated?")
        entries.append((begin, end, spec, _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])))
    entries.sort(key=lambda e: e[0])
    pin = torch.cuda.is_available()
    buffers: list[Optional[torch.Tensor]] = [None, None]
    done: list[Optional[torch.cuda.Event]] = [None, None]
    with open(file, "rb", buffering=0) as f:
        for turn, batch in enumerate(_read_batches(entries)):
            lo, hi = batch[0][0], batch[-1][1]
            slot = turn % 2
            if done[slot] is not None:
                done[slot].synchronize()  # the copies out of this buffer two batches ago are finished
            if buffers[slot] is None or buffers[slot].numel() < hi - lo:
                buffers[slot] = torch.empty(max(hi - lo, STAGING_BYTES), dtype=torch.uint8, pin_memory=pin)
            staging = buffers[slot]
            f.seek(lo)
            view = memoryview(staging.numpy())[:hi - lo]
            while view:  # readinto may return less than asked
                got = f.readinto(view)
                if not got:
                    raise CheckpointError(f"cannot read {file.name}: it ended early — truncated?")
                view = view[got:]
            for begin, end, spec, dtype, shape in batch:
                raw = staging[begin - lo:end - lo]
                if (begin - lo) % dtype.itemsize:  # safetensors does not promise aligned offsets
                    raw = raw.clone()
                yield spec, raw.view(dtype).view(shape)
            if pin:
                done[slot] = torch.cuda.Event()
                done[slot].record()


def _read_batches(entries: list) -> Iterator[list]:
    """Consecutive entries (in file order) grouped into reads of at most STAGING_BYTES (a larger
    tensor is one read of its own); a gap between tensors is read too when it is small."""
    batch: list = []
    for entry in entries:
        if batch and (entry[1] - batch[0][0] > STAGING_BYTES or entry[0] - batch[-1][1] > (1 << 20)):
            yield batch
            batch = []
        batch.append(entry)
    if batch:
        yield batch


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
