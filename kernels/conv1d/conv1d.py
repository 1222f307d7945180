"""Triton causal depthwise conv1d + SiLU over packed varlen sequences, with a slot-pooled state.

`conv_state[slot]` holds the last K-1 inputs of a sequence (oldest first). Prefill is two
launches: outputs first, then the new states — a separate launch, so no program can overwrite a
state that another program of the output pass still has to read. The output pass tiles each
sequence into [BLOCK_T tokens × BLOCK_D channels] (kernels/_common.py:ChunkTable, no host sync):
the tile's sequence, start and slot are scalars, and only a sequence's first tile (a scalar
branch) gathers taps from the old state. The state may have any strides; the pools store it
entry-major (`kernels.ref.conv1d.conv_state_zeros`), so a decode step reads and writes each of
the K-1 entries as one contiguous run over the program's channels. Launch knobs: `ConvLaunch`.
Reference: kernels/ref/conv1d.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels._common import ChunkTables, chunk_table_for


@dataclass(frozen=True)
class ConvLaunch:
    """Defaults: [16, 256] over 4 warps: ~140 registers, no spills on sm_90 ([32, 256]: ~255).
    Swept in bench_gdn."""

    block_t: int = 16  # tokens per prefill tile (prefill only)
    block_d: int = 256  # channels per program
    num_warps: int = 4


DEFAULT_PREFILL_LAUNCH = ConvLaunch()
DEFAULT_DECODE_LAUNCH = ConvLaunch(block_t=1)


@triton.jit
def _conv_prefill_out_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr, cu_ptr, tile_start_ptr, tile_end_ptr, tile_seq_ptr,
    D, stride_xt, stride_wd, stride_ss, stride_sd, stride_sk, stride_ot,
    HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile).to(tl.int64)
    end = tl.load(tile_end_ptr + tile).to(tl.int64)
    if end <= start:  # an unused tail tile of the table
        return
    seq = tl.load(tile_seq_ptr + tile)
    first_pos = start - tl.load(cu_ptr + seq).to(tl.int64)  # position of the tile's first token in its sequence
    t = tl.arange(0, BLOCK_T)  # [BT]
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    ch_ok = ch < D
    ok = (start + t < end)[:, None] & ch_ok[None, :]
    x_tile = x_ptr + start * stride_xt  # scalar base, int32 offsets below

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(K):
        shift = j - (K - 1)  # tap j reads the input `shift` (≤ 0) tokens back
        in_seq = (first_pos + t + shift >= 0)[:, None]
        tap = tl.load(x_tile + (t + shift)[:, None] * stride_xt + ch[None, :], mask=ok & in_seq, other=0.0)
        tap = tap.to(tl.float32)
        if first_pos < K - 1:  # only a sequence's first tile reaches back into the old state
            state_row = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_ss  # scalar base
            hist = (first_pos.to(tl.int32) + t + shift + (K - 1))[:, None]  # index into the old state
            old = tl.load(state_row + ch[None, :] * stride_sd + hist * stride_sk, mask=ok & ~in_seq, other=0.0)
            tap += old.to(tl.float32)
        w = tl.load(w_ptr + ch * stride_wd + j, mask=ch_ok, other=0.0).to(tl.float32)
        acc += tap * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.sigmoid(acc)
    out = out_ptr + start * stride_ot + t[:, None] * stride_ot + ch[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_prefill_state_kernel(
    x_ptr, state_ptr, slots_ptr, cu_ptr, D, stride_xt, stride_ss, stride_sd, stride_sk,
    K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_ok = ch < D
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    row = state_ptr + slot * stride_ss + ch * stride_sd  # [BD]
    # Entry i becomes input end-(K-1)+i; before the sequence start it is old entry i+len, which
    # this same thread reads before it overwrites it (i+len ≥ i), so no barrier is needed.
    for i in tl.static_range(K - 1):
        pos = end - (K - 1) + i
        if pos >= start:
            val = tl.load(x_ptr + pos * stride_xt + ch, mask=ch_ok, other=0.0).to(state_ptr.dtype.element_ty)
        else:
            val = tl.load(row + (i + (end - start)) * stride_sk, mask=ch_ok, other=0.0).to(state_ptr.dtype.element_ty)
        tl.store(row + i * stride_sk, val, mask=ch_ok)


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr,
    D, stride_xb, stride_wd, stride_ss, stride_sd, stride_sk, stride_ob,
    HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_ok = ch < D
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = state_ptr + slot * stride_ss + ch * stride_sd  # [BD]
    x = tl.load(x_ptr + b * stride_xb + ch, mask=ch_ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + ch * stride_wd + (K - 1), mask=ch_ok, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):
        hist = tl.load(row + j * stride_sk, mask=ch_ok, other=0.0).to(tl.float32)
        acc += hist * tl.load(w_ptr + ch * stride_wd + j, mask=ch_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * stride_ob + ch, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=ch_ok)
    # Shift left by one: entry j takes entry j+1 (read before this thread overwrites it), the last takes x.
    for j in tl.static_range(K - 1):
        if j + 1 < K - 1:
            val = tl.load(row + (j + 1) * stride_sk, mask=ch_ok, other=0.0)
        else:
            val = x
        tl.store(row + j * stride_sk, val.to(state_ptr.dtype.element_ty), mask=ch_ok)


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def causal_conv1d_prefill(x, weight, bias, conv_state, slots, cu_seqlens,
                          launch: ConvLaunch = DEFAULT_PREFILL_LAUNCH, chunk_tables: ChunkTables | None = None
                          ) -> torch.Tensor:
    """SiLU(causal depthwise conv) per packed sequence; x [T, D], weight [D, K], conv_state [S, D, K-1]
    (any strides; the pools store it entry-major, channels contiguous). `chunk_tables`: the step's
    shared tables for this cu_seqlens (built here if None)."""
    x = _unit_stride_rows(x)
    T, D = x.shape
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    num_seqs = slots.numel()
    if num_seqs == 0:
        return out
    cu = cu_seqlens.to(torch.int32)
    bias_arg = bias if bias is not None else weight
    K = weight.shape[1]
    if T > 0:
        tiles = chunk_table_for(cu_seqlens, launch.block_t, T, chunk_tables)  # the tables know the caller's tensor
        _conv_prefill_out_kernel[(tiles.capacity, triton.cdiv(D, launch.block_d))](
            x, weight, bias_arg, conv_state, out, slots, cu, tiles.start, tiles.seq_end, tiles.seq,
            D, x.stride(0), weight.stride(0), *conv_state.stride(), out.stride(0),
            HAS_BIAS=bias is not None, K=K, BLOCK_T=launch.block_t, BLOCK_D=launch.block_d,
            num_warps=launch.num_warps,
        )
    _conv_prefill_state_kernel[(num_seqs, triton.cdiv(D, 256))](
        x, conv_state, slots, cu, D, x.stride(0), *conv_state.stride(),
        K=K, BLOCK_D=256, num_warps=4,
    )
    return out


def causal_conv1d_decode(x, weight, bias, conv_state, slots,
                         launch: ConvLaunch = DEFAULT_DECODE_LAUNCH) -> torch.Tensor:
    """One token per sequence (x [B, D]); conv_state[slots] ([S, D, K-1], any strides) shifted in
    place by that token."""
    x = _unit_stride_rows(x)
    B, D = x.shape
    out = torch.empty((B, D), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    _conv_decode_kernel[(B, triton.cdiv(D, launch.block_d))](
        x, weight, bias if bias is not None else weight, conv_state, out, slots,
        D, x.stride(0), weight.stride(0), *conv_state.stride(), out.stride(0),
        HAS_BIAS=bias is not None, K=weight.shape[1], BLOCK_D=launch.block_d, num_warps=launch.num_warps,
    )
    return out
