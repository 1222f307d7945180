"""The W8A8 grouped expert GEMMs with the weights on the dot's M side (outᵀ = W · xᵀ), for decode's
few rows an expert: the same operands, scales, row tiles, shared-expert rows and outputs as the
pair in `grouped_gemm.py`.

Why: Hopper's FP8 tensor-core instruction (wgmma) takes at least 64 rows on its M side. A decode
tile holds 16 rows (a 35B-A3B step of 256-512 tokens routes ~8-16 rows to an expert), so Triton
runs the row-major pair's 16-row dots as f16 mma.sync on e4m3 values converted a pair at a time
(compiled for sm_90a at 16 rows, 4 warps: 160 conversions in the gate|up kernel's code, 96 in the
down kernel's), in kernels that should stream weights at HBM rate. Here the 128 weight columns of
a program are the M side and its 16-32 rows the N side (wgmma's N goes down to 8): the dots are
e4m3 wgmma, no conversion left (`tests/kernels/test_kernels_moe_fp8.py`,
`bench_moe_fp8 --sm90 --launches 16:4:3+swap`). Both operands stay K-major, as 8-bit wgmma requires: the
weights [N, K] and the activations [rows, K] as stored.

Each K step's product is scaled before it is added (acc += dot(w, x) · w_scale · x_scale[row]), so
Triton still waits for every dot; at decode sizes the dots are short beside the weight loads.
Reference: kernels/ref/moe_fp8.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from batchinfer.kernels.moe_fp8.programs import (down_rows_and_columns, gate_up_columns, program_tile,
                                                  quantize_groups_and_store, tile_tokens)


@triton.jit(do_not_specialize=["num_tiles", "total_tiles", "num_rows", "num_tokens"])
def gate_up_swapped_kernel(xq_ptr, xs_ptr, token_ptr, w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, hq_ptr, hs_ptr,
                           tile_expert_ptr, tile_start_ptr, tile_end_ptr, K, I,
                           stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn,
                           stride_hm, stride_hsm,
                           num_tiles, total_tiles, num_rows, num_tokens, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, N_BLOCKS: tl.constexpr,
                           COLUMNS_FASTEST: tl.constexpr):
    tile, pid_n, start, end, w_base, ws_base = program_tile(
        total_tiles, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr, w_ptr, ws_ptr,
        shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M, N_BLOCKS, COLUMNS_FASTEST)
    if end <= start:  # an unused tail tile of the table
        return
    rows, row_ok, tokens = tile_tokens(tile, num_tiles, start, end, num_rows, token_ptr, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    cols, gs_ptr, us_ptr = gate_up_columns(pid_n, ws_base, I, stride_wsn, BLOCK_K)
    x_ptrs = xq_ptr + tokens[None, :] * stride_xm + offs_k[:, None]  # [BK, BM]: the gathered rows, transposed
    g_ptrs = w_base + cols[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    u_ptrs = g_ptrs + I * stride_wn
    xs_ptrs = xs_ptr + tokens * stride_xsm

    acc_g = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)  # gateᵀ [128 columns, BM rows]
    acc_u = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
    for kb in range(0, K_TILES):  # constexpr trip count: the interpreter cannot loop to a runtime int
        k_ok = offs_k < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0)
        x_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)  # [BM]
        acc_g += tl.dot(g, x) * (x_s * tl.load(gs_ptr + kb))[None, :]
        acc_u += tl.dot(u, x) * (x_s * tl.load(us_ptr + kb))[None, :]
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    h = acc_g * tl.sigmoid(acc_g) * acc_u  # [128, BM]: each row's one quantization group of the down input
    quantize_groups_and_store(h, rows, row_ok, cols, pid_n, hq_ptr, hs_ptr, stride_hm, stride_hsm,
                              ROWS_ON_COLUMNS=True)


@triton.jit(do_not_specialize=["num_tiles", "total_tiles", "num_rows", "num_tokens"])
def down_swapped_kernel(hq_ptr, hs_ptr, w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, y_ptr,
                        tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
                        stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
                        num_tiles, total_tiles, num_rows, num_tokens, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, N_BLOCKS: tl.constexpr,
                        COLUMNS_FASTEST: tl.constexpr):
    tile, pid_n, start, end, w_base, ws_base = program_tile(
        total_tiles, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr, w_ptr, ws_ptr,
        shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M, N_BLOCKS, COLUMNS_FASTEST)
    if end <= start:
        return
    rows, row_ok, cols, col_ok = down_rows_and_columns(start, end, pid_n, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = hq_ptr + rows[None, :] * stride_hm + offs_k[:, None]  # [BK, BM]
    w_ptrs = w_base + cols[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    hs_ptrs = hs_ptr + rows * stride_hsm
    ws_cols = ws_base + (cols // BLOCK_K) * stride_wsn  # [BN]: wider tiles span several weight blocks
    ws_tile = ws_base + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn  # narrower ones sit in one

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ
    for kb in range(0, K_TILES):  # K = I, a whole number of 128-column groups
        h = tl.load(h_ptrs, mask=row_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        h_s = tl.load(hs_ptrs + kb, mask=row_ok, other=0.0)  # [BM]
        if BLOCK_N > BLOCK_K:
            acc += tl.dot(w, h) * tl.load(ws_cols + kb, mask=col_ok, other=0.0)[:, None] * h_s[None, :]
        else:
            acc += tl.dot(w, h) * (h_s * tl.load(ws_tile + kb))[None, :]
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[None, :] & col_ok[:, None])
