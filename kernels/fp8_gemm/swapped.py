"""The block-scaled FP8 GEMM for decode's few rows, with the weights on the dots' M side
(outᵀ = W · xᵀ): the same operands and result as `triton_fp8.fp8_block_matmul`.

Why: at decode a projection multiplies a few rows by a weight read once from HBM, so the GEMM is
bound by the weight's bytes. Hopper's FP8 tensor-core instruction (wgmma) takes at least 64 rows
on its M side, which a step of 8-32 rows pads. Here a program owns `block_n` weight rows (output
columns, the M side) and all the step's rows (the N side, which wgmma takes down to 8), so every
weight byte is read once, by one program, as e4m3 wgmma operands. Both operands stay K-major, as
8-bit wgmma requires: the weights [N, K] and the activations [M, K] as stored. Up to 32 rows it
streams the 27B's FP8 weights 1.14-1.17x as fast as cuBLAS's block-scaled GEMM; from 96 rows its
one row tile loses to cuBLAS (docs/BENCHMARKS.md, "FP8 projections at decode rows").

Few weight tiles (an output of 5,120 columns is 40 tiles of 128) leave SMs idle, so K may be
split: each split's program stores its fp32 partial, and the last of a tile's programs to
arrive (an atomic count per tile) sums the partials in split order and writes the output, so the
result does not depend on which program finishes last. Reference: `reference.fp8_gemm_reference`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels._common import cuda_capability, multiprocessor_count
from batchinfer.kernels.fp8_gemm.reference import GROUP

# Rows (tokens) up to which `fp8_gemm` runs this kernel on sm_90 instead of cuBLAS's: at the 27B's
# projections on an H100 (bench_fp8_gemm --decode) it streamed the weights 1.14x / 1.17x as fast as
# cuBLAS at 8 / 32 rows, level at 48-64, slower from 96 (its tile holds all rows: 0.5-0.9x).
SWAPPED_MAX_ROWS = 32
# Outputs up to this many columns take 128-row weight tiles (few tiles, K split), wider ones 64.
NARROW_OUTPUT = 8192
# A split keeps at least this many 128-deep K steps: fewer leave the pipeline too short to fill.
MIN_K_TILES_PER_SPLIT = 8


@dataclass(frozen=True)
class SwappedLaunch:
    """Weight rows per program (64 or 128: a weight scale block holds whole tiles), warps,
    pipeline stages, and K splits (None: `default_splits`)."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    splits: int | None = None

    def __post_init__(self):
        assert GROUP % self.block_n == 0 and self.block_n >= 64, "block_n: 64 or 128"


def default_launch(N: int) -> SwappedLaunch:
    """The H100 sweep's best at 8-32 rows: 128 weight rows a program for outputs of up to
    NARROW_OUTPUT columns (5,120: 1.4x cuBLAS), 64 for wider ones (more programs, no split)."""
    return SwappedLaunch(128 if N <= NARROW_OUTPUT else 64, num_warps=4, num_stages=3)


def row_tile(M: int) -> int:
    """The rows' side of the dots: a power of two from 16 (Triton's smallest dot) holding all M."""
    return max(16, triton.next_power_of_2(M))


def default_splits(weight_tiles: int, k_tiles: int, sms: int) -> int:
    """K splits, a power of two: doubled while the programs number fewer than the SMs and each
    split keeps MIN_K_TILES_PER_SPLIT K steps."""
    splits = 1
    while weight_tiles * splits < sms and k_tiles // (2 * splits) >= MIN_K_TILES_PER_SPLIT:
        splits *= 2
    return splits


def swapped_available(device: torch.device) -> bool:
    """Hopper (sm_90): where e4m3 wgmma runs and this kernel was measured."""
    return device.type == "cuda" and cuda_capability(device) == (9, 0)


@triton.jit
def _fp8_gemm_swapped_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                             stride_xm, stride_xsm, stride_xsg, stride_wn, stride_wsn, stride_ym,
                             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                             K_TILES: tl.constexpr, SPLITS: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
                             EVEN_K: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns: weight rows
    rows = tl.arange(0, BLOCK_M)  # [BM] the step's rows
    row_ok = rows < M
    offs_k = tl.arange(0, BLOCK_K)
    first = split * TILES_PER_SPLIT
    # A ragged last tile wraps its weight rows (loads need no column mask; those columns are not stored).
    w_ptrs = w_ptr + (cols % N)[:, None] * stride_wn + (first * BLOCK_K + offs_k)[None, :]  # [BN, BK]
    x_ptrs = x_ptr + rows[None, :] * stride_xm + (first * BLOCK_K + offs_k)[:, None]  # [BK, BM]: xᵀ
    ws_ptrs = ws_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn + first  # one scale block a tile and K step
    xs_ptrs = xs_ptr + rows * stride_xsm + first * stride_xsg  # [BM]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # outᵀ
    for i in range(TILES_PER_SPLIT):  # constexpr trip count: the interpreter cannot loop to a runtime int
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=row_ok[None, :], other=0.0)
            w_s = tl.load(ws_ptrs + i)
            x_s = tl.load(xs_ptrs + i * stride_xsg, mask=row_ok, other=0.0)
        else:  # K steps past K (the last split's, or a partial last group) add zeros
            k_left = K - (first + i) * BLOCK_K
            k_ok = offs_k < k_left
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            w_s = tl.load(ws_ptrs + i, mask=k_left > 0, other=0.0)
            x_s = tl.load(xs_ptrs + i * stride_xsg, mask=row_ok & (k_left > 0), other=0.0)
        acc += tl.dot(w, x) * (x_s * w_s)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    out_ptrs = y_ptr + rows[None, :] * stride_ym + cols[:, None]
    out_mask = row_ok[None, :] & (cols < N)[:, None]
    if SPLITS == 1:
        tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile_rows = tl.num_programs(0) * BLOCK_N
        part = part_ptr + cols[:, None] * BLOCK_M + rows[None, :]  # [BN, BM] of split 0's [tiles·BN, BM]
        tl.store(part + split * tile_rows * BLOCK_M, acc)
        tl.debug_barrier()  # every thread's partial stored before the count says so (release, below)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the tile's last program: every other partial is stored
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLITS):  # split order, whichever program came last
                total += tl.load(part + s * tile_rows * BLOCK_M, cache_modifier=".cg")  # from L2, not a stale L1
            tl.store(out_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)


def fp8_block_matmul_swapped(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                             out_dtype: torch.dtype = torch.bfloat16, launch: SwappedLaunch | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantized activations (e4m3 [M, K] unit column stride, fp32 scales [M, ceil(K/128)] of any
    strides) · weight (e4m3 [N, K], scale_inv [ceil(N/128), ceil(K/128)])ᵀ → [M, N] in out_dtype
    (into `out` [M, N], unit column stride, when given). M up to 256 (one row tile: the kernel
    pays for rows past SWAPPED_MAX_ROWS)."""
    M, K = xq.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and xq.stride(1) == 1 and weight.stride(1) == 1
    assert scale_inv.shape == (triton.cdiv(N, GROUP), triton.cdiv(K, GROUP)), "scale_inv must be one per 128x128 block"
    assert M <= 256, "the swapped GEMM holds all rows in one tile"
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    assert out.shape == (M, N) and out.stride(1) == 1
    if M == 0:
        return out
    launch = launch or default_launch(N)
    block_m = row_tile(M)
    tiles = triton.cdiv(N, launch.block_n)
    k_tiles = triton.cdiv(K, GROUP)
    splits = launch.splits or default_splits(tiles, k_tiles, multiprocessor_count(xq.device))
    per_split = triton.cdiv(k_tiles, splits)
    if splits > 1:
        part = torch.empty((splits, tiles * launch.block_n, block_m), dtype=torch.float32, device=xq.device)
        count = torch.zeros(tiles, dtype=torch.int32, device=xq.device)
    else:
        part = count = out  # not read
    _fp8_gemm_swapped_kernel[(tiles, splits)](
        xq, x_scale, weight, scale_inv, out, part, count, M, N, K,
        xq.stride(0), x_scale.stride(0), x_scale.stride(1), weight.stride(0), scale_inv.stride(0), out.stride(0),
        BLOCK_N=launch.block_n, BLOCK_M=block_m, BLOCK_K=GROUP, K_TILES=k_tiles, SPLITS=splits,
        TILES_PER_SPLIT=per_split, EVEN_K=K % GROUP == 0 and k_tiles % splits == 0,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out
