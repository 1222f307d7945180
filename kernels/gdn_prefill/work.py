"""What the three prefill stages share: the chunk constants, the planned work (inputs, chunk
table and intermediates: `plan_prefill`) each stage reads and writes, and the tile helpers of
their kernels (products with the dtype policy, chunk rows, row tiles)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels._common import ChunkTable, ChunkTables, chunk_table_for

CHUNK = 64
SUB = 16  # rows of the WY kernel's sub-blocks (its triangular inverse works on SUB×SUB blocks)
WY_KEY_STEP = 32  # d_k columns per step of the WY kernel's key products (sm90_compile: registers)


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


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass(frozen=True)
class PrefillWork:
    """Inputs, chunk table and intermediates of one prefill call; each stage reads and writes these.

    Intermediates and matmul operands are in the input dtype (bf16 on the GPU), G in fp32.
    """

    q: torch.Tensor  # [T, H_k, d_k] raw
    k: torch.Tensor  # [T, H_k, d_k] raw
    v: torch.Tensor  # [T, H_v, d_v]
    a: torch.Tensor  # [T, H_v]
    b: torch.Tensor  # [T, H_v]
    A_log: torch.Tensor  # [H_v]
    dt_bias: torch.Tensor  # [H_v]
    state: torch.Tensor  # [S, H_v, d_k, d_v]
    slots: torch.Tensor  # [B]
    cu: torch.Tensor  # [B+1] int32
    chunks: ChunkTable
    G: torch.Tensor  # [T, H_v] fp32 cumulative log-decay within each chunk
    k_inv_norm: torch.Tensor  # [T, H_k] fp32: 1/‖k‖ (rsqrt(Σk² + eps)), written by the WY kernel
    minv: torch.Tensor  # [N, H_v, C, C] M⁻¹·diag(beta) per chunk (its 10 lower 16×16 blocks)
    v_new: torch.Tensor  # [T, H_v, d_v]
    q_states: torch.Tensor  # [T, H_v, d_v]: raw q·S0 with S0 the state at the token's chunk start
    out: torch.Tensor  # [T, H_v, d_v]

    @property
    def dims(self):
        T, H_k, d_k = self.k.shape
        return T, H_k, d_k, self.v.shape[1], self.v.shape[2]


def plan_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens,
                 chunk_tables: ChunkTables | None = None) -> PrefillWork:
    q, k, v, a, b = (_unit_inner(t) for t in (q, k, v, a, b))
    assert state.stride(3) == 1, "state must be contiguous in d_v"
    T, H_k, d_k = k.shape
    H_v, d_v = v.shape[1:]
    chunks = chunk_table_for(cu_seqlens, CHUNK, T, chunk_tables)
    # Chunks and sequences index grid dims 1-2 (CUDA caps them at 65535): ~4M tokens per call.
    assert chunks.capacity <= 65535 and slots.numel() <= 65535, "split the prefill into smaller calls"
    dev, inter = q.device, q.dtype
    return PrefillWork(
        q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, slots=slots,
        cu=cu_seqlens.to(torch.int32), chunks=chunks,
        G=torch.empty((T, H_v), dtype=torch.float32, device=dev),
        k_inv_norm=torch.empty((T, H_k), dtype=torch.float32, device=dev),
        minv=torch.empty((chunks.capacity, H_v, CHUNK, CHUNK), dtype=inter, device=dev),
        v_new=torch.empty((T, H_v, d_v), dtype=inter, device=dev),
        q_states=torch.empty((T, H_v, d_v), dtype=inter, device=dev),
        out=torch.empty((T, H_v, d_v), dtype=q.dtype, device=dev),
    )


def chunk_range(work: PrefillWork, chunks: tuple[int, int] | None) -> tuple[int, int]:
    return (0, work.chunks.capacity) if chunks is None else chunks
