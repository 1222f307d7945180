"""Triton kernel of `gumbel_argmax` (contract: kernels/sampling/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_BELOW_ONE = tl.constexpr(1.0 - 2.0 ** -24)  # the largest fp32 below 1 (u = 1 would give +inf noise)


@dataclass(frozen=True)
class GumbelLaunch:
    block_v: int = 2048
    num_warps: int = 8


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (multiplication wraps mod 2^32, as the torch reference computes it)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(scaled_ptr, keys_ptr, out_ptr, V, stride_row, V_BLOCKS: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    k0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    k1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK_V], 2147483647, tl.int32)
    lanes = tl.arange(0, BLOCK_V)
    for b in range(V_BLOCKS):  # constexpr trip count: the interpreter cannot loop to a runtime int
        v = b * BLOCK_V + lanes
        inside = v < V
        x = tl.load(scaled_ptr + row * stride_row + v, mask=inside, other=float("-inf"))
        h = _mix32(_mix32(k0 ^ v.to(tl.uint32)) ^ k1)
        u = tl.minimum(((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), _BELOW_ONE)
        val = x - tl.log(-tl.log(u))
        val = tl.where(inside, val, float("-inf"))
        # Per lane the first block wins ties (strictly greater), so each lane keeps its lowest id.
        take = val > best
        best = tl.where(take, val, best)
        best_id = tl.where(take, v, best_id)
    top = tl.max(best, axis=0)
    # The first index among the lanes at the maximum (torch.argmax's tie rule); a row of all -inf picks 0.
    candidate = tl.where(best == top, best_id, 2147483647)
    pick = tl.min(candidate, axis=0)
    pick = tl.where(pick == 2147483647, 0, pick)
    tl.store(out_ptr + row, pick.to(tl.int64))


def gumbel_argmax(scaled: torch.Tensor, keys: torch.Tensor, launch: GumbelLaunch | None = None) -> torch.Tensor:
    """scaled [N, V] fp32 (unit column stride), keys [N, 2] int64 (each < 2^32) → [N] int64."""
    launch = launch or GumbelLaunch()
    assert scaled.dim() == 2 and scaled.stride(1) == 1 and scaled.dtype == torch.float32
    N, V = scaled.shape
    keys = keys.contiguous()
    out = torch.empty(N, dtype=torch.int64, device=scaled.device)
    if N:
        _gumbel_argmax_kernel[(N,)](scaled, keys, out, V, scaled.stride(0), V_BLOCKS=triton.cdiv(V, launch.block_v),
                                    BLOCK_V=launch.block_v, num_warps=launch.num_warps)
    return out
