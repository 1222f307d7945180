"""MoE layout `moe_align`: the routed assignments sorted by expert (and the grouped GEMM's row
tiles). Triton in `align.py`; `reference` is the torch layout (kernels/ref/moe_align.py)."""
from batchinfer.kernels.moe_align.align import moe_align
from batchinfer.kernels.ref import moe_align as reference

__all__ = ["moe_align", "reference"]
