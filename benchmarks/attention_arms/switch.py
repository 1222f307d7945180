"""The model's `attention_prefill` op under a PrefillPolicy for a block, for the end-to-end
benchmarks (a kernel benchmark passes its policy to backends.attention_prefill_under instead):
`prefill_policy(policy)` points the op's entry in kernels/ops.py's dispatch table at this module's
`attention_prefill`, which runs PREFILL_POLICY; on leaving, the model's own kernel
(kernels/attention/prefill.py) is back."""
from __future__ import annotations

import contextlib
from typing import Iterator

from batchinfer.kernels import ops
from benchmarks.attention_arms.backends import attention_prefill_under
from benchmarks.attention_arms.policy import DEFAULT_POLICY, PrefillPolicy

PREFILL_POLICY = DEFAULT_POLICY


def attention_prefill(q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale, *, out=None,
                      max_seqlen: int | None = None):
    """The op while `prefill_policy` is in force: PREFILL_POLICY's backend takes the long runs."""
    return attention_prefill_under(PREFILL_POLICY, q, k_cache, v_cache, kv_indices, kv_indptr, cu_seqlens, scale,
                                   out=out, max_seqlen=max_seqlen)


@contextlib.contextmanager
def prefill_policy(policy: PrefillPolicy) -> Iterator[None]:
    """Run the block with the model's attention_prefill op under `policy`."""
    global PREFILL_POLICY
    previous, entry = PREFILL_POLICY, ops.OPS["attention_prefill"]
    PREFILL_POLICY = policy
    ops.OPS["attention_prefill"] = (__name__, entry[1])
    ops.implementation.cache_clear()  # the op looks its module up once: forget it both ways
    try:
        yield
    finally:
        PREFILL_POLICY = previous
        ops.OPS["attention_prefill"] = entry
        ops.implementation.cache_clear()
