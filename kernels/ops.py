"""The one entry point the model uses for every kernel.

Each op runs its Triton kernel when the inputs live on CUDA and the kernel exists,
otherwise the plain-torch reference in `kernels/ref/` (fp32-accurate; what the CPU path and
CI run). `BATCHINFER_KERNELS=ref` forces the references everywhere (for A/B checks on a GPU).
Signatures and shapes: docs/MODULES.md.
"""
from __future__ import annotations

import importlib
import os
from functools import lru_cache
from typing import Callable

import torch

_REF_MODULES = {
    "rms_norm": "kernels.ref.norm",
    "gated_rms_norm": "kernels.ref.norm",
    "add_rms_norm": "kernels.ref.norm",
    "rms_norm_rope": "kernels.ref.rope",
    "silu_mul": "kernels.ref.activation",
    "causal_conv1d_prefill": "kernels.ref.conv1d",
    "causal_conv1d_decode": "kernels.ref.conv1d",
    "gdn_prefill": "kernels.ref.gdn",
    "gdn_decode": "kernels.ref.gdn",
    "replay_decode": "kernels.ref.replay",
    "replay_fold": "kernels.ref.replay",
    "store_kv": "kernels.ref.attention",
    "attention_prefill": "kernels.ref.attention",
    "attention_decode": "kernels.ref.attention",
}
_TRITON_MODULES = {
    "rms_norm": "kernels.rmsnorm",
    "gated_rms_norm": "kernels.rmsnorm",
    "add_rms_norm": "kernels.rmsnorm",
    "rms_norm_rope": "kernels.rope",
    "silu_mul": "kernels.activation",
    "causal_conv1d_prefill": "kernels.conv1d",
    "causal_conv1d_decode": "kernels.conv1d",
    "gdn_prefill": "kernels.gdn_prefill",
    "gdn_decode": "kernels.gdn_decode",
    "replay_decode": "kernels.replay_ssm",
    "replay_fold": "kernels.replay_ssm",
    "store_kv": "kernels.attention",
    "attention_prefill": "kernels.attention_prefill_backends",
    "attention_decode": "kernels.attention",
}


@lru_cache(maxsize=None)
def _impl(name: str, triton: bool) -> Callable:
    if triton:
        try:
            return getattr(importlib.import_module(_TRITON_MODULES[name]), name)
        except (ImportError, AttributeError):
            pass  # no Triton kernel for this op (yet): the reference serves
    return getattr(importlib.import_module(_REF_MODULES[name]), name)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("BATCHINFER_KERNELS", "auto") != "ref"


def _dispatch(name: str) -> Callable:
    def op(*args, **kwargs):
        return _impl(name, _use_triton(args[0]))(*args, **kwargs)

    op.__name__ = name
    op.__doc__ = f"Dispatches `{name}` to Triton on CUDA, else to kernels/ref (see docs/MODULES.md)."
    return op


rms_norm = _dispatch("rms_norm")
gated_rms_norm = _dispatch("gated_rms_norm")
add_rms_norm = _dispatch("add_rms_norm")
rms_norm_rope = _dispatch("rms_norm_rope")
silu_mul = _dispatch("silu_mul")
causal_conv1d_prefill = _dispatch("causal_conv1d_prefill")
causal_conv1d_decode = _dispatch("causal_conv1d_decode")
gdn_prefill = _dispatch("gdn_prefill")
gdn_decode = _dispatch("gdn_decode")
replay_decode = _dispatch("replay_decode")
replay_fold = _dispatch("replay_fold")
store_kv = _dispatch("store_kv")
attention_prefill = _dispatch("attention_prefill")
attention_decode = _dispatch("attention_decode")
