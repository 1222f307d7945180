"""Paged attention over the KV pool: `store_kv`, causal `attention_prefill`, split-K
`attention_decode` (Triton in `attention.py`) with its shared-prefix stage (`shared_prefix.py`);
the model's prefill op (`prefill.py`: cuDNN for long runs, the Triton kernel for the rest);
`reference` is the torch maths (kernels/ref/attention.py)."""
from batchinfer.kernels.attention.attention import attention_decode, attention_prefill, store_kv
from batchinfer.kernels.attention.shared_prefix import SharedPrefixLaunch
from batchinfer.kernels.ref import attention as reference

__all__ = ["SharedPrefixLaunch", "attention_decode", "attention_prefill", "reference", "store_kv"]
