"""Which rows, tokens and weights a program of the grouped expert kernels owns (the FP8-activation
kernels in `grouped_gemm.py` and `swapped.py`, the bf16-activation ones in `w8a16.py`),
and how a gate|up program stores silu(gate) · up for the down kernel."""
from __future__ import annotations

import triton
import triton.language as tl

from batchinfer.kernels.fp8_gemm.reference import AMAX_FLOOR, FP8_MAX
from batchinfer.kernels.fp8_gemm.triton_fp8 import _round_to_e4m3

_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@triton.jit
def tile_and_column_block(total_tiles, N_BLOCKS: tl.constexpr, COLUMNS_FASTEST: tl.constexpr):
    """(row tile, column block) of this program in a 1-D grid of total_tiles · N_BLOCKS."""
    pid = tl.program_id(0)
    if COLUMNS_FASTEST:
        return pid // N_BLOCKS, pid % N_BLOCKS
    return pid % total_tiles, pid // total_tiles


@triton.jit
def tile_rows_and_weights(tile, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                          w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M: tl.constexpr):
    """A row tile's first row, its end, and its expert's weights and scales: a tile of the table,
    or past the table a tile of the shared expert (rows num_rows + t for every token t)."""
    if tile < num_tiles:
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        w_base = w_ptr + expert * stride_we
        ws_base = ws_ptr + expert * stride_wse
    else:
        start = num_rows + (tile - num_tiles) * BLOCK_M
        end = num_rows + num_tokens
        w_base = shared_w_ptr
        ws_base = shared_ws_ptr
    return start, end, w_base, ws_base


@triton.jit
def program_tile(total_tiles, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                 w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M: tl.constexpr,
                 N_BLOCKS: tl.constexpr, COLUMNS_FASTEST: tl.constexpr):
    """This program's (row tile, column block), the tile's rows [start, end) and its expert's
    weights and scales: the opening of every grouped expert kernel (end <= start: nothing to do)."""
    tile, pid_n = tile_and_column_block(total_tiles, N_BLOCKS, COLUMNS_FASTEST)
    start, end, w_base, ws_base = tile_rows_and_weights(
        tile, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
        w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M)
    return tile, pid_n, start, end, w_base, ws_base


@triton.jit
def gate_up_columns(pid_n, ws_base, I, stride_wsn, BLOCK_K: tl.constexpr):
    """A gate|up program's 128 gate rows of w [BK] (its up rows are I below) and the pointers to
    the gate and up blocks' scales along K."""
    cols = pid_n * BLOCK_K + tl.arange(0, BLOCK_K)
    gs_ptr = ws_base + pid_n * stride_wsn
    return cols, gs_ptr, gs_ptr + (I // BLOCK_K) * stride_wsn


@triton.jit
def tile_tokens(tile, num_tiles, start, end, num_rows, token_ptr, BLOCK_M: tl.constexpr):
    """A gate|up tile's rows, which of them exist, and each row's token [BM] int64: a routed row
    gathers its token, the shared expert's row num_rows + t is token t."""
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    routed = tile < num_tiles
    tokens = tl.where(routed, tl.load(token_ptr + rows, mask=row_ok & routed, other=0), rows - num_rows).to(tl.int64)
    return rows, row_ok, tokens


@triton.jit
def down_rows_and_columns(start, end, pid_n, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A down tile's rows [BM] int64 and which exist, its output columns [BN] and which exist."""
    rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < end, cols, cols < N


@triton.jit
def quantize_groups_and_store(h, rows, row_ok, cols, pid_n, hq_ptr, hs_ptr, stride_hm, stride_hsm,
                              ROWS_ON_COLUMNS: tl.constexpr = False):
    """silu(gate) · up, one 128-column group of the down GEMM's input per row, → e4m3 at its row's
    scale amax / 448, stored with the scale: the down kernel's operand. h is [BM rows, 128], or
    [128, BM rows] with ROWS_ON_COLUMNS (the swapped kernel's transposed accumulator)."""
    if ROWS_ON_COLUMNS:
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), axis=0), _AMAX_FLOOR), _FP8_MAX)  # [BM]
        q = tl.math.div_rn(h, scale[None, :])
        offsets = rows.to(tl.int64)[None, :] * stride_hm + cols[:, None]
        row_mask = row_ok[None, :]
    else:
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), axis=1), _AMAX_FLOOR), _FP8_MAX)  # [BM]
        q = tl.math.div_rn(h, scale[:, None])
        offsets = rows.to(tl.int64)[:, None] * stride_hm + cols[None, :]
        row_mask = row_ok[:, None]
    q = tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)
    tl.store(hq_ptr + offsets, _round_to_e4m3(q).to(tl.float8e4nv), mask=row_mask)
    tl.store(hs_ptr + rows.to(tl.int64) * stride_hsm + pid_n, scale, mask=row_ok)
