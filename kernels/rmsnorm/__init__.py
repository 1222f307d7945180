"""RMSNorm ops (plain, gated, fused with the residual add): Triton in `rmsnorm.py`; `reference`
is the torch maths (kernels/ref/norm.py)."""
from batchinfer.kernels.ref import norm as reference
from batchinfer.kernels.rmsnorm.rmsnorm import add_rms_norm, gated_rms_norm, rms_norm

__all__ = ["add_rms_norm", "gated_rms_norm", "reference", "rms_norm"]
