"""FP8 block-quantized projection weights and the one `linear` every projection call site uses.

`Fp8Weight` holds a checkpoint's e4m3 weight [..., N, K] with its fp32 `scale_inv`, one per
128 × 128 block ([..., ceil(N/128), ceil(K/128)]); `linear(x, w)` runs the block-scaled FP8
GEMM (kernels/fp8_gemm: activations quantized per token group on the fly) for one, a plain
`F.linear` for a 16/32-bit weight. A fused projection (q|k|v, gate|up, ...) can be FP8 only
if every part but the last starts on a 128-row block boundary (`block_aligned`): a block of
the checkpoint's scales then never straddles two fused parts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.models.layers.params import empty_param
from batchinfer.kernels.fp8_gemm import FP8_DTYPE, GROUP, block_quantize, dequantize_weight, fp8_gemm


_DEQUANT_CHUNK = 1 << 27  # elements of fp32 staging per dequantized chunk (512 MB)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Weight(nn.Module):
    """An e4m3 weight [*lead, N, K] (`weight`) and its per-block fp32 `scale_inv`."""

    def __init__(self, *shape: int, device: torch.device | str):
        super().__init__()
        *lead, N, K = shape
        self.weight = empty_param(*shape, dtype=FP8_DTYPE, device=device)
        self.scale_inv = empty_param(*lead, _cdiv(N, GROUP), _cdiv(K, GROUP), dtype=torch.float32, device=device)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[*lead, N, K] in dtype (on CUDA one Triton pass over the stack; elsewhere stacked
        weights a few at a time, so the fp32 staging stays small beside the result)."""
        if self.weight.dim() == 2 or self.weight.is_cuda:
            return dequantize_weight(self.weight, self.scale_inv, dtype)
        out = torch.empty(self.weight.shape, dtype=dtype, device=self.weight.device)
        per_chunk = max(1, _DEQUANT_CHUNK // (self.weight.shape[-2] * self.weight.shape[-1]))
        for start in range(0, self.weight.shape[0], per_chunk):
            rows = slice(start, start + per_chunk)
            out[rows] = dequantize_weight(self.weight[rows], self.scale_inv[rows], dtype)
        return out

    @torch.no_grad()
    def quantize_from_(self, value: torch.Tensor) -> None:
        """Fill from a 16/32-bit weight of the same shape (block-quantized here)."""
        q, s = block_quantize(value.to(self.weight.device))
        self.weight.copy_(q)
        self.scale_inv.copy_(s)


Projection = "torch.Tensor | Fp8Weight"


def projection(rows: int, cols: int, *, dtype: torch.dtype, device: torch.device | str, fp8: bool):
    """A [rows, cols] projection weight: FP8 with block scales, or a plain parameter."""
    if fp8:
        return Fp8Weight(rows, cols, device=device)
    return empty_param(rows, cols, dtype=dtype, device=device)


def block_aligned(*part_rows: int) -> bool:
    """True when every fused part but the last is a whole number of 128-row blocks."""
    return all(rows % GROUP == 0 for rows in part_rows[:-1])


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [T, K] · weightᵀ → [T, N] in x's dtype, FP8 GEMM for an `Fp8Weight`."""
    if isinstance(weight, Fp8Weight):
        return fp8_gemm(x, weight.weight, weight.scale_inv, x.dtype)
    return F.linear(x, weight)


def dense_weight(weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a plain tensor of `dtype` (dequantized when FP8)."""
    return weight.dequantize(dtype) if isinstance(weight, Fp8Weight) else weight
