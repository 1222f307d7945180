"""Reference FP8 routed experts (plain torch, fp32 math): what `kernels/moe_fp8/` computes.

Rows are routed (token, expert) assignments sorted by expert, the layout `SparseMoE` builds for
the grouped GEMM: row r reads token `token_of[r]`, expert e owns rows [ends[e-1], ends[e]).
Per expert: the token rows quantized per (token, 128-column group) as the dense FP8 GEMM does,
times the dequantized gate|up block; `silu(gate) · up` in fp32; that quantized per 128-column
group again; times the dequantized down block. Products in fp32, output rounded once. W8A16
(`launch.w8a16`, `kernels/moe_fp8/w8a16.py`): the rows as they are, the weights dequantized to
their dtype, `silu(gate) · up` rounded to it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from batchinfer.kernels.fp8_gemm.reference import GROUP, block_dequantize, quantize_act_reference


def quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] through per-(row, 128-column group) e4m3 and back, in fp32."""
    q, s = quantize_act_reference(x)
    return q.float() * s.repeat_interleave(GROUP, dim=1)[:, :x.shape[1]]


class SharedExpert(NamedTuple):
    """An expert every token takes (the MoE block's shared expert), in one routed expert's shapes:
    w13 e4m3 [2I, H] with s13 [2I/128, ceil(H/128)], w2 e4m3 [H, I] with s2 [ceil(H/128), I/128]."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor


FP16_MAX = 65504.0


class _W8A16(NamedTuple):
    """How the W8A16 kernels round: the activations' dtype, and whether the dots run in fp16."""

    dtype: torch.dtype
    fp16_dots: bool

    def operand(self, a: torch.Tensor) -> torch.Tensor:
        """Activations (or silu·up) as they enter the dots, as fp32 values: rounded to the
        activations' dtype, or clamped to fp16's range and rounded to fp16."""
        if self.fp16_dots:
            return a.float().clamp(-FP16_MAX, FP16_MAX).half().float()
        return a.to(self.dtype).float()

    def weights(self, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """An e4m3 [N, K] block-scaled weight as the dots see it, as fp32 values: dequantized to
        the activations' dtype (one rounding), or e4m3 → fp16 times the fp16-rounded scale in fp16."""
        if not self.fp16_dots:
            return block_dequantize(q, scale_inv, self.dtype).float()
        N, K = q.shape
        scale = scale_inv.repeat_interleave(GROUP, dim=0)[:N].repeat_interleave(GROUP, dim=1)[:, :K]
        return (q.to(torch.float16) * scale.to(torch.float16)).float()


def _expert(a: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
            w8a16: _W8A16 | None = None) -> torch.Tensor:
    """Rows a [rows, H] (fp32) through one FP8 expert → [rows, H] in fp32. W8A8: `a` already
    quantized-dequantized, silu(gate)·up quantized the same way; W8A16: `a` as the dots take it,
    the weights dequantized as they do, silu(gate)·up rounded to the activations' dtype."""
    dequantize = block_dequantize if w8a16 is None else (lambda q, s: w8a16.weights(q, s))
    gate, up = (a @ dequantize(w13, s13).t()).chunk(2, dim=-1)
    h = F.silu(gate) * up  # [rows, I]
    h = quantize_dequantize(h) if w8a16 is None else w8a16.operand(h)
    return h @ dequantize(w2, s2).t()


def moe_fp8(x: torch.Tensor, token_of: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
            w2: torch.Tensor, s2: torch.Tensor, launch=None, tiles=None, shared: SharedExpert | None = None,
            out: torch.Tensor | None = None, down_tiles=None) -> torch.Tensor:
    """x [T, H]; token_of [M]; ends [E] (cumulative rows per expert); w13 e4m3 [E, 2I, H] with
    s13 [E, 2I/128, ceil(H/128)]; w2 e4m3 [E, H, I] with s2 [E, ceil(H/128), I/128] → [M, H] in x's dtype;
    with `shared`, [M + T, H]: row M + t is token t through the shared expert. `launch.w8a16`
    selects the W8A16 maths (activations unquantized, weights dequantized to x's dtype, silu·up
    rounded to it; `launch.fp16_dots`: both in fp16 as the dots take them); the rest of `launch`,
    `tiles` and `down_tiles` (the Triton kernel's row tiles) are unused: rows are taken per expert;
    `out`, when given, receives the result."""
    M, H = token_of.shape[0], x.shape[1]
    w8a16 = _W8A16(x.dtype, launch.fp16_dots) if launch is not None and launch.w8a16 else None
    # [T, H]: per-row quantization commutes with the gather; W8A16 takes the activations as they are
    a_tokens = quantize_dequantize(x) if w8a16 is None else w8a16.operand(x)
    y = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    a = a_tokens[token_of.long()]  # [M, H]
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            y[start:end] = _expert(a[start:end], w13[expert], s13[expert], w2[expert], s2[expert], w8a16)
        start = end
    if shared is not None:
        y = torch.cat([y, _expert(a_tokens, *shared, w8a16)])
    y = y.to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
