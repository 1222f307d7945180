"""FP8 routed experts as grouped FP8 GEMMs with block scales: `moe_fp8` (Triton, `grouped_gemm.py`;
row tiles per expert in `tiles.py`); `reference` is the fp32 torch maths (kernels/ref/moe_fp8.py)."""
from batchinfer.kernels.moe_fp8.grouped_gemm import KernelLaunch, MoeFp8Launch, default_launch, moe_fp8
from batchinfer.kernels.ref import moe_fp8 as reference

__all__ = ["KernelLaunch", "MoeFp8Launch", "default_launch", "moe_fp8", "reference"]
