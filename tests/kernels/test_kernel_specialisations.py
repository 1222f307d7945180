"""The decode kernels compile one variant for every CUDA-graph bucket: the runtime ints that vary
with the batch or the split count (batch, num_splits, first_split, num_seqs, the lse strides) are
`do_not_specialize`, and the merge's split block is fixed. Counted by the precompile trace itself,
run on the CPU against a stand-in sm_90 driver (tests/host_trace.py) in a child process without
the interpreter; one traced variant is then compiled for sm_90."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchinfer.engine import precompile as P

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import collections, json, sys
    import torch
    import triton
    from batchinfer.engine import precompile as P
    from batchinfer.engine.cuda_graphs import bucket_sizes
    from batchinfer.kernels.attention import SharedPrefixLaunch, attention_decode
    from batchinfer.kernels.replay_ssm.flush import flush_full_rings
    from tests.host_trace import SM90, traced

    BUCKETS = bucket_sizes(256)
    H, H_KV, D, CTX = 24, 4, 256, 2176  # qwen3.5-27b attention; a rag document + question

    def decode_steps():
        k = torch.empty(4096, H_KV, D, dtype=torch.bfloat16)
        for b in BUCKETS:
            q = torch.empty(b, H, D, dtype=torch.bfloat16)
            idx = torch.zeros(b * CTX, dtype=torch.int64)
            ptr = torch.arange(b + 1, dtype=torch.int32) * CTX
            for splits, shared_splits in ((None, None), (1, 1), (3, 2), (16, 32), (64, 7)):
                attention_decode(q, k, k, idx, ptr, 0.1, num_splits=splits,
                                 shared_with_prev=torch.zeros(b, dtype=torch.int32),
                                 shared_launch=SharedPrefixLaunch(num_splits=shared_splits))

    def flushes():
        S, L, HK, HV, DK = 300, 16, 16, 48, 128  # qwen3.5-27b GDN
        ckpt = torch.empty(S, HV, DK, DK, dtype=torch.bfloat16)
        ring_k, ring_u = torch.empty(S, L, HK, DK, dtype=torch.bfloat16), torch.empty(S, L, HV, DK, dtype=torch.bfloat16)
        ring_g, cursor = torch.empty(S, L, HV), torch.zeros(S, dtype=torch.int32)
        for b in BUCKETS:
            flush_full_rings(ckpt, ring_k, ring_u, ring_g, cursor, torch.zeros(b, dtype=torch.int64))

    decode = traced(decode_steps)
    flush = traced(flushes)
    counts = collections.Counter(s.name for s in decode + flush)
    merge = next(s for s in decode if s.name == "_attn_decode_merge_kernel")
    P.compile_specialisation(merge, SM90)  # the traced variant compiles for the H200
    print(json.dumps({"counts": counts, "flush_blocks": len({max(16, triton.next_power_of_2(b)) for b in BUCKETS})}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not P.supported_triton(), reason="the trace drives triton 3.6 internals")
def test_decode_kernels_compile_one_variant_for_every_bucket(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    counts = result["counts"]
    assert counts["_attn_decode_split_kernel"] == 1, counts
    assert counts["_shared_prefix_kernel"] == 1, counts
    assert counts["_attn_decode_merge_kernel"] == 1, counts
    # BLOCK_B (the batch's power of two) stays a constexpr: one variant per block, not per bucket.
    assert counts["replay_flush_kernel"] == result["flush_blocks"], counts


KEYS_SCRIPT = textwrap.dedent("""
    import glob, json, os
    import torch
    from batchinfer.engine import precompile as P
    from batchinfer.kernels.attention import SharedPrefixLaunch, attention_decode
    from tests.host_trace import host_driver

    H, H_KV, D, CTX, B = 24, 4, 256, 2176, 16

    def decode_step():  # the split kernel is hashed before the shared-prefix one, as in the engine
        k = torch.empty(4096, H_KV, D, dtype=torch.bfloat16)
        attention_decode(torch.empty(B, H, D, dtype=torch.bfloat16), k, k, torch.zeros(B * CTX, dtype=torch.int64),
                         torch.arange(B + 1, dtype=torch.int32) * CTX, 0.1, num_splits=3,
                         shared_with_prev=torch.zeros(B, dtype=torch.int32),
                         shared_launch=SharedPrefixLaunch(num_splits=2))

    if __name__ == "__main__":
        with host_driver():
            pending = P.start_precompile(decode_step)
            entries = len(glob.glob(os.environ["TRITON_CACHE_DIR"] + "/*"))
            report = pending.finish()  # waits for the workers, then preloads in this process
        print(json.dumps({"compiled": report.compiled, "kernels": report.kernels,
                          "recompiled_here": len(glob.glob(os.environ["TRITON_CACHE_DIR"] + "/*")) - entries}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not P.supported_triton(), reason="the precompile runs on triton 3.6 only")
def test_the_engine_finds_what_the_workers_compiled(tmp_path):
    """Every kernel a worker compiled is a cache hit when the engine process preloads it: the
    cache keys are settled in one order in both (else `_shared_prefix_kernel`, whose helpers the
    engine hashed first through the split kernel, is compiled again at start-up)."""
    script = tmp_path / "keys_child.py"
    script.write_text(KEYS_SCRIPT)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), BATCHINFER_PRECOMPILE="2",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600,
                           cwd=REPO)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["kernels"] == result["compiled"] == 3
    assert result["recompiled_here"] == 0
