"""Grouped expert GEMMs with FP8 weights and 16-bit activations (W8A16): gate|up with SiLU·mul
fused, then down, over the same row tiles and shared-expert rows as `grouped_gemm.py`.

Why a second pair: the W8A8 kernels scale each 128-deep product before adding it
(acc += dot(a, b) · a_scale · b_scale), and Triton waits for every such dot, so the tensor cores
idle while it is scaled. Here the activations are not quantized, and each program dequantizes
its weight tile in registers (e4m3 · its block scale, rounded to the activations' dtype) and
feeds it as the dot's register operand: the products accumulate straight into the loop-carried
accumulator, which Triton keeps in flight across K steps (wgmma waits leave 15 groups pending on
sm_90a, `tests/kernels/test_kernels_moe_fp8.py`). The dots run at the 16-bit tensor-core rate, half
the FP8 one; whether that beats the stalled FP8 pair is the H200's to say. The weights sit on the
dot's M side (out^T = W · x^T), the tokens on its N side, which also suits decode's few rows per
expert.

The maths is the model dequantized to the activations' dtype (`block_dequantize` rounds the same
way), with fp32 accumulation and silu(gate) · up rounded once to that dtype between the GEMMs;
fp32 activations take true fp32 products (`PRECISION` "ieee", not tf32), as the tests pin down.
`FP16_DOTS`: the dots in fp16 instead — the activations arrive converted (clamped to fp16's range,
`fp16_operand`), silu · up is stored in fp16, and weight tiles are scaled in fp16: on sm_90a the
bf16 path spends ~4 instructions a weight (e4m3 → f16 → f32, the fp32 product, → bf16) beside its
dots, which may outrun the tensor cores; fp16 ~2 (591 against 717 PTX instructions a thread per
K step at 64 rows). Operands converted inside the loop would have to pass through shared memory
before their dot, which Triton then waits for.
Reference: `kernels/ref/moe_fp8.py` (`moe_fp8(..., launch)` with `launch.w8a16`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels.moe_fp8.programs import down_rows_and_columns, gate_up_columns, program_tile, tile_tokens

_FP16_MAX = tl.constexpr(65504.0)


def fp16_operand(x: torch.Tensor) -> torch.Tensor:
    """Activations for fp16 dots: clamped to fp16's range (a bf16 value beyond it would be inf)."""
    return x.clamp(-65504.0, 65504.0).to(torch.float16)


@triton.jit
def _weight_tile(q, scale, dtype: tl.constexpr, FP16_DOTS: tl.constexpr):
    """An e4m3 weight tile times its block scale(s), in the dots' dtype: the product in fp32 and
    rounded once (`block_dequantize`'s rounding), or e4m3 → fp16 (exact) times the scale rounded
    to fp16, in fp16 (fewer instructions a weight)."""
    if FP16_DOTS:  # one return: the compiler checks every return's type, taken or not
        w = q.to(tl.float16) * scale.to(tl.float16)
    else:
        w = (q.to(tl.float32) * scale).to(dtype)
    return w


@triton.jit(do_not_specialize=["num_tiles", "total_tiles", "num_rows", "num_tokens"])
def gate_up_w8a16_kernel(x_ptr, token_ptr, w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, h_ptr,
                         tile_expert_ptr, tile_start_ptr, tile_end_ptr, K, I,
                         stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm,
                         num_tiles, total_tiles, num_rows, num_tokens, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         K_TILES: tl.constexpr, N_BLOCKS: tl.constexpr, COLUMNS_FASTEST: tl.constexpr,
                         PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr):
    tile, pid_n, start, end, w_base, ws_base = program_tile(
        total_tiles, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr, w_ptr, ws_ptr,
        shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M, N_BLOCKS, COLUMNS_FASTEST)
    if end <= start:  # an unused tail tile of the table
        return
    rows, row_ok, tokens = tile_tokens(tile, num_tiles, start, end, num_rows, token_ptr, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    cols, gs_ptr, us_ptr = gate_up_columns(pid_n, ws_base, I, stride_wsn, BLOCK_K)
    x_ptrs = x_ptr + tokens[None, :] * stride_xm + offs_k[:, None]  # [BK, BM]: the gathered rows, transposed
    g_ptrs = w_base + cols[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    u_ptrs = g_ptrs + I * stride_wn

    acc_g = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)  # gateᵀ [128 columns, BM rows]
    acc_u = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
    for kb in range(0, K_TILES):  # constexpr trip count: the interpreter cannot loop to a runtime int
        k_ok = offs_k < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)  # in the dots' dtype already
        g = _weight_tile(tl.load(g_ptrs, mask=k_ok[None, :], other=0.0), tl.load(gs_ptr + kb), x.dtype, FP16_DOTS)
        u = _weight_tile(tl.load(u_ptrs, mask=k_ok[None, :], other=0.0), tl.load(us_ptr + kb), x.dtype, FP16_DOTS)
        acc_g = tl.dot(g, x, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(u, x, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    h = acc_g * tl.sigmoid(acc_g) * acc_u  # [128, BM]
    if FP16_DOTS:  # h is the down GEMM's fp16 operand: clamped to fp16's range, not infinite
        h = tl.minimum(tl.maximum(h, -_FP16_MAX), _FP16_MAX)
    rows64 = rows.to(tl.int64)
    tl.store(h_ptr + rows64[None, :] * stride_hm + cols[:, None], h.to(h_ptr.dtype.element_ty), mask=row_ok[None, :])


@triton.jit(do_not_specialize=["num_tiles", "total_tiles", "num_rows", "num_tokens"])
def down_w8a16_kernel(h_ptr, w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, y_ptr,
                      tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
                      stride_hm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
                      num_tiles, total_tiles, num_rows, num_tokens, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, N_BLOCKS: tl.constexpr,
                      COLUMNS_FASTEST: tl.constexpr, PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr):
    tile, pid_n, start, end, w_base, ws_base = program_tile(
        total_tiles, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr, w_ptr, ws_ptr,
        shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M, N_BLOCKS, COLUMNS_FASTEST)
    if end <= start:
        return
    rows, row_ok, cols, col_ok = down_rows_and_columns(start, end, pid_n, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[None, :] * stride_hm + offs_k[:, None]  # [BK, BM]
    w_ptrs = w_base + cols[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    ws_rows = ws_base + (cols // BLOCK_K) * stride_wsn  # [BN]: a tile may span several weight blocks

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ
    for kb in range(0, K_TILES):  # K = I, a whole number of 128-column groups
        h = tl.load(h_ptrs, mask=row_ok[None, :], other=0.0)
        scale = tl.load(ws_rows + kb, mask=col_ok, other=0.0)  # [BN]
        w = _weight_tile(tl.load(w_ptrs, mask=col_ok[:, None], other=0.0), scale[:, None], h.dtype, FP16_DOTS)
        acc = tl.dot(w, h, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[None, :] & col_ok[:, None])
