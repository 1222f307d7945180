"""Fused sampling kernels. `gumbel_argmax(scaled [N, V] fp32, keys [N, 2] int64) -> [N] int64`:

The noise is the engine's counter hash (batchinfer/engine/sampler.py: `uniform_noise`,
`unit_interval`, `_gumbel_argmax` are the torch reference this kernel reproduces): for token v
of a row with keys (k0, k1), h = mix32(mix32(k0 ^ v) ^ k1), u = ((h >> 8) + 0.5) / 2^24 kept
below 1, and the pick is argmax(scaled + -log(-log(u))), the first index on ties. One pass over
the logits instead of ~10 elementwise passes over [N, V] int64 temporaries.

`row_logprobs(logits [N, V] fp32, tokens [N] int64, rows [R] int64, k) -> [R, 1 + 2k] fp32`:
the raw distribution's logprobs of the rows that ask, packed as `token_logprobs` (the torch
reference, batchinfer/engine/sampler.py) packs them: the drawn token's logprob, the top-k
logprobs in descending order (equal values: the lower id first), the top-k ids as int32 bit
patterns. One pass per row: an online logsumexp and a running top-k, instead of torch's
logsumexp and topk passes over [R, V].
"""
from batchinfer.kernels.sampling.gumbel import GumbelLaunch, gumbel_argmax
from batchinfer.kernels.sampling.logprobs import LogprobsLaunch, row_logprobs

__all__ = ["GumbelLaunch", "LogprobsLaunch", "gumbel_argmax", "row_logprobs"]
