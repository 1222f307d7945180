"""Causal depthwise conv1d + SiLU over packed sequences (prefill) and one token (decode): Triton
in `conv1d.py`; `reference` is the torch maths (kernels/ref/conv1d.py)."""
from batchinfer.kernels.conv1d.conv1d import (DEFAULT_DECODE_LAUNCH, DEFAULT_PREFILL_LAUNCH, ConvLaunch, causal_conv1d_decode,
                                   causal_conv1d_prefill)
from batchinfer.kernels.ref import conv1d as reference

__all__ = ["ConvLaunch", "DEFAULT_DECODE_LAUNCH", "DEFAULT_PREFILL_LAUNCH", "causal_conv1d_decode",
           "causal_conv1d_prefill", "reference"]
