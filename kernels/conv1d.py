"""Triton causal depthwise conv1d + SiLU over packed varlen sequences, with a slot-pooled state.

`conv_state[slot]` holds the last K-1 inputs of a sequence (oldest first). Prefill is two
launches: outputs first (every token gathers its K taps from x or, before its sequence start,
from the old state), then the new states — a separate launch, so no program can overwrite a
state that another program of the output pass still has to read. Reference: kernels/ref/conv1d.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# An [8, 256] tile: no register spills on sm_90 ([32, 128] spills: each of the K taps keeps two
# pointer tiles live).
BLOCK_T = 8
BLOCK_D = 256


@triton.jit
def _conv_prefill_out_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr, cu_ptr, token_seq_ptr,
    T, D, stride_xt, stride_wd, stride_ss, stride_sd, stride_ot,
    HAS_BIAS: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    tok_ok, ch_ok = tok < T, ch < D
    seq = tl.load(token_seq_ptr + tok, mask=tok_ok, other=0)
    start = tl.load(cu_ptr + seq, mask=tok_ok, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + seq, mask=tok_ok, other=0).to(tl.int64)
    ok = tok_ok[:, None] & ch_ok[None, :]

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(K):
        src = tok.to(tl.int64) - (K - 1) + j  # [BT] input position of tap j
        in_seq = (src >= start)[:, None]
        from_x = tl.load(x_ptr + src[:, None] * stride_xt + ch[None, :], mask=ok & in_seq, other=0.0)
        hist = (src - start + (K - 1))[:, None]  # index into the old state when src < start
        from_state = tl.load(
            state_ptr + slot[:, None] * stride_ss + ch[None, :] * stride_sd + hist, mask=ok & ~in_seq, other=0.0
        )
        tap = tl.where(in_seq, from_x.to(tl.float32), from_state.to(tl.float32))
        w = tl.load(w_ptr + ch * stride_wd + j, mask=ch_ok, other=0.0).to(tl.float32)
        acc += tap * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + ch[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_prefill_state_kernel(
    x_ptr, state_ptr, slots_ptr, cu_ptr, D, stride_xt, stride_ss, stride_sd,
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
            val = tl.load(row + i + (end - start), mask=ch_ok, other=0.0).to(state_ptr.dtype.element_ty)
        tl.store(row + i, val, mask=ch_ok)


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr,
    D, stride_xb, stride_wd, stride_ss, stride_sd, stride_ob,
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
        hist = tl.load(row + j, mask=ch_ok, other=0.0).to(tl.float32)
        acc += hist * tl.load(w_ptr + ch * stride_wd + j, mask=ch_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * stride_ob + ch, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=ch_ok)
    # Shift left by one: entry j takes entry j+1 (read before this thread overwrites it), the last takes x.
    for j in tl.static_range(K - 1):
        if j + 1 < K - 1:
            val = tl.load(row + j + 1, mask=ch_ok, other=0.0)
        else:
            val = x
        tl.store(row + j, val.to(state_ptr.dtype.element_ty), mask=ch_ok)


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def causal_conv1d_prefill(x, weight, bias, conv_state, slots, cu_seqlens) -> torch.Tensor:
    """SiLU(causal depthwise conv) per packed sequence; x [T, D], weight [D, K], conv_state [S, D, K-1]."""
    x = _unit_stride_rows(x)
    assert conv_state.stride(2) == 1, "conv_state must be contiguous in its last dim"
    T, D = x.shape
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    num_seqs = slots.numel()
    if num_seqs == 0:
        return out
    cu = cu_seqlens.to(torch.int32)
    lengths = (cu[1:] - cu[:-1]).long()
    seq_ids = torch.arange(num_seqs, device=x.device, dtype=torch.int32)
    token_seq = torch.repeat_interleave(seq_ids, lengths, output_size=T)  # [T], no host sync
    bias_arg = bias if bias is not None else weight
    K = weight.shape[1]
    if T > 0:
        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))
        _conv_prefill_out_kernel[grid](
            x, weight, bias_arg, conv_state, out, slots, cu, token_seq,
            T, D, x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, K=K, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=4,
        )
    _conv_prefill_state_kernel[(num_seqs, triton.cdiv(D, BLOCK_D))](
        x, conv_state, slots, cu, D, x.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=K, BLOCK_D=BLOCK_D, num_warps=4,
    )
    return out


def causal_conv1d_decode(x, weight, bias, conv_state, slots) -> torch.Tensor:
    """One token per sequence (x [B, D]); conv_state[slots] shifted in place by that token."""
    x = _unit_stride_rows(x)
    assert conv_state.stride(2) == 1, "conv_state must be contiguous in its last dim"
    B, D = x.shape
    out = torch.empty((B, D), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    _conv_decode_kernel[(B, triton.cdiv(D, BLOCK_D))](
        x, weight, bias if bias is not None else weight, conv_state, out, slots,
        D, x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, K=weight.shape[1], BLOCK_D=BLOCK_D, num_warps=4,
    )
    return out
