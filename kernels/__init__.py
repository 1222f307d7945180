"""GPU kernels: each op a package beside its torch reference, run through `kernels.ops`.

Besides the ops, the layers above use these helpers, exported here so that they never import the
private `kernels._common`: `ChunkTables` (a step's shared prefill chunk tables), `cuda_capability`,
`PREFILL_CHUNK` (the GDN prefill's chunk length). They resolve on first use: importing `kernels`
(for `kernels.ops` or `kernels.ref`, which the CPU path runs) does not import Triton.
"""
from __future__ import annotations

import importlib

_EXPORTS = {  # name -> (module, attribute)
    "ChunkTables": ("batchinfer.kernels._common", "ChunkTables"),
    "cuda_capability": ("batchinfer.kernels._common", "cuda_capability"),
    "PREFILL_CHUNK": ("batchinfer.kernels.gdn_prefill", "CHUNK"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    return getattr(importlib.import_module(module), attribute)
