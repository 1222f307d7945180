"""SwiGLU activation `silu_mul`: Triton in `activation.py`; `reference` is the torch maths
(kernels/ref/activation.py)."""
from batchinfer.kernels.activation.activation import DEFAULT_SILU_MUL_LAUNCH, SiluMulLaunch, silu_mul
from batchinfer.kernels.ref import activation as reference

__all__ = ["DEFAULT_SILU_MUL_LAUNCH", "SiluMulLaunch", "reference", "silu_mul"]
