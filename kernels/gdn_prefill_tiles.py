"""Tile helpers shared by the chunked GDN prefill kernels (kernels/gdn_prefill_kernels.py,
gdn_prefill_wy.py, gdn_prefill_state.py): products with the dtype policy, chunk rows, row tiles."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b accumulated in fp32, operands in DOT_DTYPE: the input dtype (bf16/fp16 tensor cores),
    or true fp32 ("ieee", not tf32) for fp32 inputs, which is the exact path the tests pin down."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _chunk_rows(chunk_start_ptr, chunk_end_ptr, chunk, C: tl.constexpr):
    """Chunk `chunk` of the table: first token, row count (≤ 0 for an unused tail chunk), and
    its C local row indices, token rows and row mask."""
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    n_rows = tl.load(chunk_end_ptr + chunk).to(tl.int64) - start
    i = tl.arange(0, C)
    return start, n_rows, i, start + i, i < n_rows


@triton.jit
def _load_rows(base, rows, ok, row_stride, cols, col_ok):
    """Tile [rows, cols] at base + row·row_stride + col, masked-out entries 0. int32 offsets on a
    scalar int64 base: int64 offset tiles would double the registers of every address tile."""
    return tl.load(base + rows[:, None] * row_stride + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
