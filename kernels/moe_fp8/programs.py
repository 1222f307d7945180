"""Which rows, tokens and weights a program of the grouped expert kernels owns (both the FP8-activation
kernels in `grouped_gemm.py` and the bf16-activation ones in `w8a16.py`)."""
from __future__ import annotations

import triton
import triton.language as tl


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
