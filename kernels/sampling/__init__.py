"""Fused Gumbel-max sampling: `gumbel_argmax(scaled [N, V] fp32, keys [N, 2] int64) -> [N] int64`.

The noise is the engine's counter hash (batchinfer/engine/sampler.py: `uniform_noise`,
`unit_interval`, `_gumbel_argmax` are the torch reference this kernel reproduces): for token v
of a row with keys (k0, k1), h = mix32(mix32(k0 ^ v) ^ k1), u = ((h >> 8) + 0.5) / 2^24 kept
below 1, and the pick is argmax(scaled + -log(-log(u))), the first index on ties. One pass over
the logits instead of ~10 elementwise passes over [N, V] int64 temporaries.
"""
from batchinfer.kernels.sampling.gumbel import GumbelLaunch, gumbel_argmax

__all__ = ["GumbelLaunch", "gumbel_argmax"]
