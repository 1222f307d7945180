"""FP8 block-scaled GEMM (Qwen / DeepSeek fine-grained FP8): the op and its torch reference.

`fp8_gemm(x [M, K], weight e4m3 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)]) -> [M, N]`
quantizes x per (token, 128-column group) on the fly (scale = amax / 448, e4m3) and
multiplies with fp32 accumulation; output in x's dtype (or `out_dtype`). CUDA: on sm_90 the
swapped Triton GEMM (`swapped.py`) for decode's few rows and cuBLAS's block-scaled GEMM
(`cublas_fp8.py`) above them, else the Triton kernels in `triton_fp8.py`; elsewhere (or
`BATCHINFER_KERNELS=ref`) `fp8_gemm_reference` (dequantize, then an fp32 matmul).
`block_quantize` / `block_dequantize` convert weights; `dequantize_weight` is `block_dequantize`
with a Triton kernel on CUDA (one pass: 1 byte read, 2 written per bf16 element; the model
dequantizes FP8 routed experts with it).
"""
from __future__ import annotations

import os

import torch

from batchinfer.kernels.fp8_gemm.reference import (FP8_DTYPE, FP8_MAX, GROUP, block_dequantize, block_quantize,
                                        fp8_gemm_reference, quantize_act_reference)

__all__ = ["FP8_DTYPE", "FP8_MAX", "GROUP", "block_dequantize", "block_quantize", "dequantize_weight", "fp8_gemm",
           "fp8_gemm_reference", "quantize_act", "quantize_act_reference"]


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("BATCHINFER_KERNELS") != "ref"


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], fp32 scales [M, ceil(K/128)])."""
    if _use_triton(x):
        from batchinfer.kernels.fp8_gemm.triton_fp8 import quantize_act as triton_quantize_act
        return triton_quantize_act(x)
    return quantize_act_reference(x)


def gemm_backend() -> str:
    """BATCHINFER_FP8_GEMM: `auto` (on sm_90 the swapped GEMM up to SWAPPED_MAX_ROWS rows, cuBLAS's
    block-scaled GEMM above them where it runs, else Triton), `cublas` (cuBLAS at every row count)
    or `triton` (benchmarks compare them)."""
    return os.environ.get("BATCHINFER_FP8_GEMM", "auto").strip().lower() or "auto"


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if not _use_triton(x):
        return fp8_gemm_reference(x, weight, scale_inv, out_dtype)
    from batchinfer.kernels.fp8_gemm import cublas_fp8, swapped
    from batchinfer.kernels.fp8_gemm.triton_fp8 import fp8_block_matmul
    from batchinfer.kernels.fp8_gemm.triton_fp8 import quantize_act as triton_quantize_act

    out_dtype = out_dtype or x.dtype
    if (gemm_backend() == "auto" and x.dim() == 2 and x.shape[0] <= swapped.SWAPPED_MAX_ROWS
            and swapped.swapped_available(x.device)):
        return swapped.fp8_block_matmul_swapped(*triton_quantize_act(x), weight, scale_inv, out_dtype)
    if (gemm_backend() != "triton" and x.dim() == 2 and cublas_fp8.shapes_supported(x.shape[1], scale_inv)
            and cublas_fp8.available(x.device)):
        M = x.shape[0]
        xq, xs = triton_quantize_act(x, rows=cublas_fp8.padded_rows(M), scales_transposed=True)
        try:
            return cublas_fp8.block_scaled_mm(xq, xs.t(), weight, scale_inv, out_dtype)[:M]
        except RuntimeError as error:  # this torch / cuBLAS cannot: Triton from now on
            if gemm_backend() == "cublas" or isinstance(error, torch.OutOfMemoryError):
                raise  # out of memory is the step's to handle, not a broken cuBLAS
            cublas_fp8.mark_broken(x.device, error)
            return fp8_block_matmul(xq[:M], xs[:M].contiguous(), weight, scale_inv, out_dtype)
    xq, xs = triton_quantize_act(x)
    return fp8_block_matmul(xq, xs, weight, scale_inv, out_dtype)


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [..., N, K] · its 128 × 128 block scales → dtype (bit-identical to `block_dequantize`)."""
    if _use_triton(q) and q.is_contiguous() and scale_inv.is_contiguous():
        from batchinfer.kernels.fp8_gemm.triton_fp8 import block_dequantize as triton_block_dequantize
        return triton_block_dequantize(q, scale_inv, dtype)
    return block_dequantize(q, scale_inv, dtype)
