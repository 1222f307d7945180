"""The prefill-attention backends the model's cuDNN + Triton prefill (kernels/attention/prefill.py)
was measured against, for benchmarks/attention_backends.py and the end-to-end benchmarks:
`policy` (which backend takes the long runs, from which length on), `backends` (the packed
varlen / FA2-style and per-sequence SDPA calls, each over one batch), `prefill_fa` (an FA2-style
Triton kernel) and `switch` (`prefill_policy(policy)`: the model's attention_prefill op under a
policy for a block)."""
