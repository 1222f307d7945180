"""The entry point the model uses for every kernel.

`OPS` is the one dispatch table: each op names the package of its Triton kernel and the module of
its plain-torch reference (fp32-accurate; what the CPU path and CI run). An op runs its Triton
kernel when its first input lives on CUDA, else the reference; `BATCHINFER_KERNELS=ref` forces
the references everywhere (for A/B checks on a GPU). A Triton kernel that cannot load on CUDA
raises `KernelLoadError`: running the slow reference there instead would hide a broken install.
Signatures and shapes: docs/MODULES.md.
"""
from __future__ import annotations

import importlib
import os
from functools import lru_cache
from typing import Callable

import torch

# op -> (Triton package, reference module)
OPS: dict[str, tuple[str, str]] = {
    "rms_norm": ("batchinfer.kernels.rmsnorm", "batchinfer.kernels.ref.norm"),
    "gated_rms_norm": ("batchinfer.kernels.rmsnorm", "batchinfer.kernels.ref.norm"),
    "add_rms_norm": ("batchinfer.kernels.rmsnorm", "batchinfer.kernels.ref.norm"),
    "rms_norm_rope": ("batchinfer.kernels.rope", "batchinfer.kernels.ref.rope"),
    "silu_mul": ("batchinfer.kernels.activation", "batchinfer.kernels.ref.activation"),
    "causal_conv1d_prefill": ("batchinfer.kernels.conv1d", "batchinfer.kernels.ref.conv1d"),
    "causal_conv1d_decode": ("batchinfer.kernels.conv1d", "batchinfer.kernels.ref.conv1d"),
    "gdn_prefill": ("batchinfer.kernels.gdn_prefill", "batchinfer.kernels.ref.gdn"),
    "gdn_decode": ("batchinfer.kernels.gdn_decode", "batchinfer.kernels.ref.gdn"),
    "replay_decode": ("batchinfer.kernels.replay_ssm", "batchinfer.kernels.ref.replay"),
    "replay_fold": ("batchinfer.kernels.replay_ssm", "batchinfer.kernels.ref.replay"),
    "store_kv": ("batchinfer.kernels.attention", "batchinfer.kernels.ref.attention"),
    "attention_prefill": ("batchinfer.kernels.attention.prefill", "batchinfer.kernels.ref.attention"),
    "attention_decode": ("batchinfer.kernels.attention", "batchinfer.kernels.ref.attention"),
    "moe_fp8": ("batchinfer.kernels.moe_fp8", "batchinfer.kernels.ref.moe_fp8"),
    "moe_combine": ("batchinfer.kernels.moe_combine", "batchinfer.kernels.ref.moe_combine"),
    "moe_route": ("batchinfer.kernels.moe_route", "batchinfer.kernels.ref.moe_route"),
    "moe_align": ("batchinfer.kernels.moe_align", "batchinfer.kernels.ref.moe_align"),
}


class KernelLoadError(RuntimeError):
    """A Triton kernel was needed (CUDA input) but its module failed to import."""


_import_module = importlib.import_module  # one seam, so tests can fail the import


@lru_cache(maxsize=None)
def implementation(name: str, triton: bool) -> Callable:
    """The function that serves op `name`: its Triton kernel, or its reference. Raises
    `KernelLoadError` when the Triton kernel cannot load (never falls back)."""
    triton_module, ref_module = OPS[name]
    if not triton:
        return getattr(_import_module(ref_module), name)
    try:
        return getattr(_import_module(triton_module), name)
    except (ImportError, AttributeError) as err:
        raise KernelLoadError(
            f"batchinfer.kernels.ops.{name}: the Triton kernel {triton_module}.{name} cannot load for a CUDA input "
            f"({type(err).__name__}: {err}); fix the install, or set BATCHINFER_KERNELS=ref to run the "
            f"torch references on purpose") from err


def uses_triton(t: torch.Tensor) -> bool:
    """Whether an op whose first input is `t` runs its Triton kernel."""
    return t.is_cuda and os.environ.get("BATCHINFER_KERNELS", "auto") != "ref"


def _dispatch(name: str) -> Callable:
    def op(*args, **kwargs):
        return implementation(name, uses_triton(args[0]))(*args, **kwargs)

    op.__name__ = name
    op.__doc__ = f"Dispatches `{name}` to its Triton kernel on CUDA, else to its reference (kernels.ops.OPS)."
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
moe_fp8 = _dispatch("moe_fp8")
moe_combine = _dispatch("moe_combine")
moe_route = _dispatch("moe_route")
moe_align = _dispatch("moe_align")
