"""The block-scaled FP8 GEMM through cuBLASLt: torch's `scaled_mm` with DeepSeek-style block
scales (activations 1 × 128 per token, weights 128 × 128), which cuBLAS runs on Hopper from
CUDA 12.9. A maintained library kernel beats our Triton GEMM where it runs; `supported` says
where that is, and `fp8_gemm` (kernels/fp8_gemm) falls back to Triton everywhere else.

cuBLAS's layout rules: the activation scales outer-dim-major ([M, K/128] with unit row
stride), M a multiple of 4 (rows are padded, then cut off), the weight scales as the
[K/128, N/128] transpose view, K/128 a multiple of 4 (else not supported here).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from batchinfer.kernels.fp8_gemm.reference import FP8_DTYPE, GROUP

log = logging.getLogger(__name__)
_BROKEN: set[str] = set()  # devices where a first call failed: Triton from then on


def shapes_supported(K: int, scale_inv: torch.Tensor) -> bool:
    """The weight's shape fits cuBLAS's block-scaled layout (whole 128 × 4 column blocks)."""
    return K % (4 * GROUP) == 0 and scale_inv.dim() == 2 and scale_inv.shape[1] == K // GROUP


def available(device: torch.device) -> bool:
    """This torch has the block-scaled `scaled_mm` and `device` is an sm_90 GPU not known broken."""
    if device.type != "cuda" or str(device) in _BROKEN or not hasattr(F, "scaled_mm"):
        return False
    return _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:  # asked at every FP8 projection call: once per device
    return torch.cuda.get_device_capability(index) == (9, 0)


def padded_rows(M: int) -> int:
    return M + (-M % 4)


def block_scaled_mm(xq: torch.Tensor, x_scale_t: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """xq e4m3 [M4, K] (M4 = padded_rows(M)), x_scale_t fp32 [G, M4] (the scales' transpose,
    contiguous: the outer-dim-major layout cuBLAS reads), weight e4m3 [N, K], scale_inv fp32
    [N/128, K/128] → [M4, N] in out_dtype."""
    return F.scaled_mm(xq, weight.t(), x_scale_t.t(), F.ScalingType.BlockWise1x128,
                       scale_inv.t(), F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def mark_broken(device: torch.device, error: Exception) -> None:
    _BROKEN.add(str(device))
    log.warning("cuBLAS block-scaled FP8 GEMM failed on %s (%s: %s); using the Triton FP8 GEMM",
                device, type(error).__name__, str(error).splitlines()[0] if str(error) else "")


__all__ = ["FP8_DTYPE", "available", "block_scaled_mm", "mark_broken", "padded_rows", "shapes_supported"]
