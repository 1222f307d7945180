"""The W8A8 gate|up kernel with each weight block's scale folded into the activations' quantization,
so that its FP8 dots accumulate in flight (for prefill-wide steps).

Why: the row-major kernel scales each 128-deep product before adding it
(acc += dot(a, b) · a_scale[row, kb] · w_scale[kb]), and Triton waits for every such dot
(`wgmma.wait_group 0` after each on sm_90a), so the tensor cores idle while it is scaled: the
expert GEMMs run ~500 TFLOP/s in prefill against ~1,300 for a dense FP8 GEMM. Here a program
quantizes its own rows in registers, per (row, K block), at the scale c[row] / w_scale[kb] with
c[row] = max over kb of amax[row, kb] · w_scale[kb] / 448 for its column block. Then every K
step's product carries the same factor c[row], so the dots accumulate straight into the
loop-carried accumulators (`acc = dot(q, w, acc)`, A from registers) and c[row] scales the sums
once at the end: compiled for sm_90a at 128 rows, 16 warps, the waits leave 7 groups in flight
(`tests/kernels/test_kernels_moe_fp8.py`).

The weights are the checkpoint's e4m3 values and scales, used exactly. The activations are
quantized to e4m3 as in the row-major kernel (3 mantissa bits, ties to even), each group at its
own scale; a group whose amax · w_scale lies far below its row's largest sits lower in e4m3's
range (below 2^-6 of the scale, values lose precision as subnormals: values that small add
little to the dot). The gate and up blocks have their own weight scales, so each row is quantized
twice. The program reads its rows in the model's dtype (not pre-quantized e4m3) and the rows'
per-group amax ([T, K/128] fp32, `group_amax`). silu(gate) · up is quantized for the down
kernel exactly as the row-major kernel does. Reference: kernels/ref/moe_fp8.py (`launch.fold_scales`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from batchinfer.kernels.fp8_gemm.reference import AMAX_FLOOR, FP8_MAX, GROUP
from batchinfer.kernels.fp8_gemm.triton_fp8 import _round_to_e4m3
from batchinfer.kernels.moe_fp8.programs import (gate_up_columns, program_tile, quantize_groups_and_store,
                                                  tile_tokens)

_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
# The interpreter's fp32 → e4m3 cast mishandles a carry into the next binade, so there the values
# are rounded first (`_round_to_e4m3`, ~10 integer and float operations a value); the GPU's
# cast rounds to nearest even itself, and in this loop those operations would outnumber the dots.
_ROUND_BEFORE_CAST = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def group_amax(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] (K a multiple of 128) → max |x| per (row, 128-column group) [T, K/128] fp32."""
    T, K = x.shape
    assert K % GROUP == 0, "the folded kernel takes whole 128-column groups"
    return torch.linalg.vector_norm(x.view(T, K // GROUP, GROUP), ord=float("inf"), dim=-1).float()


@triton.jit
def _folded_operand(x, factor):
    """Rows x [BM, BK] fp32 at their per-row factor [BM] → e4m3, saturated at ±448."""
    q = tl.minimum(tl.maximum(x * factor[:, None], -_FP8_MAX), _FP8_MAX)
    if _ROUND_BEFORE_CAST:
        q = _round_to_e4m3(q)
    return q.to(tl.float8e4nv)


@triton.jit(do_not_specialize=["num_tiles", "total_tiles", "num_rows", "num_tokens"])
def gate_up_folded_kernel(x_ptr, amax_ptr, token_ptr, w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, hq_ptr, hs_ptr,
                          tile_expert_ptr, tile_start_ptr, tile_end_ptr, I,
                          stride_xm, stride_am, stride_we, stride_wn, stride_wse, stride_wsn,
                          stride_hm, stride_hsm,
                          num_tiles, total_tiles, num_rows, num_tokens, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, BLOCK_KT: tl.constexpr,
                          N_BLOCKS: tl.constexpr, COLUMNS_FASTEST: tl.constexpr):
    tile, pid_n, start, end, w_base, ws_base = program_tile(
        total_tiles, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr, w_ptr, ws_ptr,
        shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M, N_BLOCKS, COLUMNS_FASTEST)
    if end <= start:  # an unused tail tile of the table
        return
    rows, row_ok, tokens = tile_tokens(tile, num_tiles, start, end, num_rows, token_ptr, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    cols, gs_ptr, us_ptr = gate_up_columns(pid_n, ws_base, I, stride_wsn, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]  # [BM, BK] in the model's dtype
    g_ptrs = w_base + cols[None, :] * stride_wn + offs_k[:, None]  # [BK, BN] view of the [2I, K] weight
    u_ptrs = g_ptrs + I * stride_wn

    # Each row's common factor for this column block: c = max_kb amax[row, kb] · w_scale[kb] / 448.
    kbs = tl.arange(0, BLOCK_KT)
    kb_ok = kbs < K_TILES
    amax = tl.load(amax_ptr + tokens[:, None] * stride_am + kbs[None, :], mask=row_ok[:, None] & kb_ok[None, :],
                   other=0.0)  # [BM, KT]
    c_g = tl.math.div_rn(tl.maximum(tl.max(amax * tl.load(gs_ptr + kbs, mask=kb_ok, other=0.0)[None, :], axis=1),
                                    _AMAX_FLOOR), _FP8_MAX)  # [BM]
    c_u = tl.math.div_rn(tl.maximum(tl.max(amax * tl.load(us_ptr + kbs, mask=kb_ok, other=0.0)[None, :], axis=1),
                                    _AMAX_FLOOR), _FP8_MAX)

    acc_g = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for kb in range(0, K_TILES):  # K = hidden, a whole number of 128-column groups
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        a_g = _folded_operand(x, tl.math.div_rn(tl.load(gs_ptr + kb) + tl.zeros_like(c_g), c_g))
        a_u = _folded_operand(x, tl.math.div_rn(tl.load(us_ptr + kb) + tl.zeros_like(c_u), c_u))
        acc_g = tl.dot(a_g, tl.load(g_ptrs), acc_g)
        acc_u = tl.dot(a_u, tl.load(u_ptrs), acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    gate = acc_g * c_g[:, None]
    h = gate * tl.sigmoid(gate) * (acc_u * c_u[:, None])  # [BM, 128]: one quantization group of the down input
    quantize_groups_and_store(h, rows, row_ok, cols, pid_n, hq_ptr, hs_ptr, stride_hm, stride_hsm)
