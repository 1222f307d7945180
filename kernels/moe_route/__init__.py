"""MoE routing `moe_route`: Triton in `route.py`; `reference` is the fp32 torch maths
(kernels/ref/moe_route.py)."""
from batchinfer.kernels.moe_route.route import DEFAULT_MOE_ROUTE_LAUNCH, MoeRouteLaunch, moe_route
from batchinfer.kernels.ref import moe_route as reference

__all__ = ["DEFAULT_MOE_ROUTE_LAUNCH", "MoeRouteLaunch", "moe_route", "reference"]
