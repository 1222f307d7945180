"""Per-head RMSNorm + partial rotary embedding of q/k: Triton in `rope.py`; `reference` is the
torch maths (kernels/ref/rope.py)."""
from batchinfer.kernels.ref import rope as reference
from batchinfer.kernels.rope.rope import rms_norm_rope

__all__ = ["reference", "rms_norm_rope"]
