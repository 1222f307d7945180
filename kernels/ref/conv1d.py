"""Reference causal depthwise conv1d with SiLU, over packed varlen sequences and a slot pool.

The conv state of a slot holds the last K-1 *inputs* (pre-activation, oldest first) seen by
that sequence, so a sequence can be continued token by token (decode) or segment by segment
(prefill resuming from a cached prefix) with results identical to one long prefill.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_state_zeros(slots: int, channels: int, kernel_size: int, dtype: torch.dtype,
                     device: torch.device | str) -> torch.Tensor:
    """A zeroed conv-state pool [slots, channels, kernel_size - 1], stored entry-major (a
    transposed view of [slots, K-1, channels]): a decode step then reads and writes each history
    entry as one contiguous run over the channels (the Triton kernels take any strides; the
    channel-major layout cost the decode kernel coalesced, vectorised access)."""
    return torch.zeros(slots, kernel_size - 1, channels, dtype=dtype, device=device).transpose(1, 2)


def _conv_window(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(conv) of every full K-wide window along the last dim of `window` [..., D, K-1+L]."""
    kernel = weight.shape[1]
    taps = window.float().unfold(-1, kernel, 1)  # [..., D, L, K]
    out = (taps * weight.float()[:, None, :]).sum(-1)  # [..., D, L]
    if bias is not None:
        out = out + bias.float()[:, None]
    return F.silu(out)


def causal_conv1d_prefill(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    conv_state: torch.Tensor,  # [S, D, K-1], updated in place
    slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B+1]
    chunk_tables=None,  # the Triton kernel's shared chunk tables of the step; ignored here
) -> torch.Tensor:
    """SiLU(causal depthwise conv) per sequence, each starting from and ending in `conv_state[slot]`."""
    out = torch.empty_like(x)  # [T, D]
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        start, end = bounds[i], bounds[i + 1]
        history = conv_state[slot].float()  # [D, K-1]
        window = torch.cat([history, x[start:end].float().t()], dim=-1)  # [D, K-1+L]
        out[start:end] = _conv_window(window, weight, bias).t().to(x.dtype)
        # The last K-1 inputs may reach back into the old state when L < K-1.
        conv_state[slot] = window[:, window.shape[-1] - history.shape[-1]:].to(conv_state.dtype)
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: output for it, and the state shifted by one input.

    x [B, D]; weight [D, K], bias [D] as in the prefill; conv_state [S, D, K-1], updated in place; slots [B]."""
    window = torch.cat([conv_state[slots].float(), x.float()[:, :, None]], dim=-1)  # [B, D, K]
    out = _conv_window(window, weight, bias)[:, :, 0]  # [B, D]
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    return out.to(x.dtype)
