"""batchinfer: offline batch inference for GDN-hybrid language models.

`kernels/`, `cache/` and `jobs/` sit at the top of the checkout; `batchinfer/kernels` etc. are links
to them, so they import as `batchinfer.kernels` etc. through the ordinary import system, installed or
not. They have no `__init__.py` of their own (namespace packages): from the checkout root a folder
without one never shadows an installed package of the same name (PyPI's `kernels`, which
transformers imports).
"""
__version__ = "0.1.0"

__all__ = ["LLM", "run"]


def __getattr__(name: str):
    # `import batchinfer` stays light (no torch): the API loads on first use.
    if name in __all__:
        from batchinfer import api
        return getattr(api, name)
    raise AttributeError(f"module 'batchinfer' has no attribute {name!r}")
