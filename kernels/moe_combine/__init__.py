"""MoE combine `moe_combine`: Triton in `combine.py`; `reference` is the fp32 torch maths
(kernels/ref/moe_combine.py)."""
from batchinfer.kernels.moe_combine.combine import DEFAULT_MOE_COMBINE_LAUNCH, MoeCombineLaunch, moe_combine
from batchinfer.kernels.ref import moe_combine as reference

__all__ = ["DEFAULT_MOE_COMBINE_LAUNCH", "MoeCombineLaunch", "moe_combine", "reference"]
