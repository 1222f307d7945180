"""Triton Gated DeltaNet decode: one recurrent step per sequence, state updated in place by slot.

One program per (sequence, value head, d_v block): the [d_k, BLOCK_V] state tile is read once,
decayed, corrected by the delta rule and written once, in fp32 registers, so the step is bound
by state bandwidth (read + write of the pool entry). The state load is issued first and both
reductions over d_k (Sᵀk and Sᵀq) run on the decayed state together, using
o = S'ᵀq = (exp(g)·S)ᵀq + (k·q)·u, so the write-back waits on one reduction round, not two.
Launch knobs: `DecodeLaunch`. Reference: kernels/ref/gdn.py:gdn_decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import KernelLaunch, gdn_gate_terms, l2_normalise_vector, next_pow2_at_least_16

# block_v = 32 over 8 warps: ~120 registers/thread on sm_90 and B·H_v·d_v/32 programs, enough to
# saturate bandwidth from small batches on. benchmarks/bench_gdn.py sweeps alternatives.
DEFAULT_LAUNCH = KernelLaunch(block_v=32, num_warps=8, num_stages=1)


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_bb,
    stride_s0, stride_s1, stride_s2, stride_ob, stride_oh,
    D_K, D_V, scale,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    key_head = head // GROUP
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < D_K, vv < D_V
    tile_ok = k_ok[:, None] & v_ok[None, :]

    # The state tile first: it is the only large load, everything else fits under its latency.
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    tile = state_ptr + slot * stride_s0 + head * stride_s1 + kk[:, None] * stride_s2 + vv[None, :]
    S = tl.load(tile, mask=tile_ok, other=0.0)  # [BK, BV]
    q = tl.load(q_ptr + seq * stride_qb + key_head * stride_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * stride_kb + key_head * stride_kh + kk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq * stride_vb + head * stride_vh + vv, mask=v_ok, other=0.0).to(tl.float32)  # [BV]
    a = tl.load(a_ptr + seq * stride_ab + head).to(tl.float32)
    b = tl.load(b_ptr + seq * stride_bb + head).to(tl.float32)
    g, beta = gdn_gate_terms(a, b, tl.load(A_log_ptr + head).to(tl.float32), tl.load(dt_bias_ptr + head).to(tl.float32))
    q = l2_normalise_vector(q) * scale  # [BK]
    k = l2_normalise_vector(k)  # [BK]

    S = S.to(tl.float32) * tl.exp(g)
    k_dot_S = tl.sum(S * k[:, None], axis=0)  # [BV]
    q_dot_S = tl.sum(S * q[:, None], axis=0)  # [BV]
    u = beta * (v - k_dot_S)  # [BV]
    tl.store(tile, (S + k[:, None] * u[None, :]).to(state_ptr.dtype.element_ty), mask=tile_ok)
    o = q_dot_S + tl.sum(q * k, axis=0) * u
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok)


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_decode(q, k, v, a, b, A_log, dt_bias, state, slots, launch: KernelLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """One step per sequence: q, k [B, H_k, d_k]; v [B, H_v, d_v]; a, b [B, H_v]; state [S, H_v, d_k, d_v]."""
    q, k, v, a, b = (_unit_inner(t) for t in (q, k, v, a, b))
    assert state.stride(3) == 1, "state must be contiguous in d_v"
    B, H_k, d_k = k.shape
    H_v, d_v = v.shape[1:]
    out = torch.empty((B, H_v, d_v), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    block_k = next_pow2_at_least_16(d_k)
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    grid = (B, H_v, triton.cdiv(d_v, block_v))
    _gdn_decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        d_k, d_v, d_k ** -0.5,
        GROUP=H_v // H_k, BLOCK_K=block_k, BLOCK_V=block_v,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return out
