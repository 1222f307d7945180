"""The kernel helpers the layers above use besides `kernels.ops`, so that they never import the
private `kernels._common`: `ChunkTables` (a step's shared prefill chunk tables), `cuda_capability`,
`PREFILL_CHUNK` (the GDN prefill's chunk length). They resolve on first use, so importing this module
does not import Triton.

`kernels/` itself has no `__init__.py`: from the checkout root it must not shadow PyPI's `kernels`
(which transformers imports), and a folder without one loses to any installed package of its name.
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
        raise AttributeError(f"module 'batchinfer.kernels.public' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    return getattr(importlib.import_module(module), attribute)
