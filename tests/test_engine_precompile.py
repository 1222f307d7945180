"""batchinfer/engine/precompile.py on the CPU: the trace records what triton's cache hook reports
(and tells triton to skip), the workers compile it for sm_90 without a device, and the prefill
shapes cover triton's integer classes. The launch interception itself needs a GPU (test_engine_gpu)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchinfer.engine import precompile as P
from batchinfer.engine.precompile import StepShapes, prefill_shapes, worker_count

REPO = Path(__file__).resolve().parents[1]

# Run without the interpreter (conftest sets it): @triton.jit then builds real JITFunctions.
SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from batchinfer.engine import precompile as P
    from batchinfer.kernels.rmsnorm import rmsnorm

    fn = rmsnorm.add_rms_norm_kernel
    signature = {name: "*bf16" for name in ("x_ptr", "delta_ptr", "w_ptr", "sum_ptr", "out_ptr")}
    signature.update({name: "i32" for name in ("stride_x", "stride_delta", "stride_sum", "stride_out", "N")})
    signature.update(eps="fp32", BLOCK_N="constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(10)}
    options = make_backend(GPUTarget("cuda", 90, 32)).parse_options({"num_warps": 4})

    def launches():  # what JITFunction._do_compile does first for a kernel not yet compiled
        for block in (1024, 1024, 2048):  # the repeat is one specialisation
            skipped = fn._call_hook(triton.knobs.runtime.jit_cache_hook, f"key{block}", signature, 0,
                                    {(11,): block}, options, [attrs], False)
            assert skipped is True  # the trace tells triton to skip the compile and the launch

    specs = P.trace_specialisations(launches)
    assert triton.knobs.runtime.jit_cache_hook is None  # restored
    assert [(s.module, s.name, s.key) for s in specs] == [
        ("batchinfer.kernels.rmsnorm.rmsnorm", "add_rms_norm_kernel", "key1024"),
        ("batchinfer.kernels.rmsnorm.rmsnorm", "add_rms_norm_kernel", "key2048")]
    target = ("cuda", 90, 32)
    assert not any(P.is_cached(s, target) for s in specs)
    compiled = P.compile_all(specs, workers=int(sys.argv[1]), target=target)
    assert all(P.is_cached(s, target) for s in specs)  # the lookup triton.compile itself makes
    cubins = sorted(p.name for p in Path(sys.argv[2]).rglob("*.cubin"))
    print(json.dumps({"compiled": compiled, "cubins": cubins}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not P.supported_triton(), reason="the trace drives triton 3.6 internals (_call_hook)")
@pytest.mark.parametrize("workers", [2])
def test_traced_specialisations_compile_for_sm90_in_worker_processes(tmp_path, workers):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(workers), str(tmp_path / "cache")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert result["compiled"] == 2
    assert result["cubins"] == ["add_rms_norm_kernel.cubin"] * 2  # two specialisations in the shared cache


def test_worker_count_from_environment(monkeypatch):
    monkeypatch.setenv("BATCHINFER_PRECOMPILE", "0")
    assert worker_count(10) == 0
    monkeypatch.setenv("BATCHINFER_PRECOMPILE", "3")
    assert worker_count(10) == 3 and worker_count(2) == 2
    monkeypatch.setenv("BATCHINFER_PRECOMPILE", "many")
    with pytest.raises(ValueError, match="BATCHINFER_PRECOMPILE"):
        worker_count(1)


def _classes(n: int) -> str:
    return "one" if n == 1 else "div16" if n % 16 == 0 else "other"


def test_prefill_shapes_cover_integer_classes_within_the_limits():
    shapes = StepShapes(decode_buckets=[1, 2, 256], graph_ctx_cap=32768, decode_hint=True, max_batch_tokens=8192,
                        max_running=256, max_model_len=262144, replay=True)
    batches = prefill_shapes(shapes)
    tokens = {_classes(sum(n for _, n in b)) for b in batches}
    seqs = {_classes(len(b)) for b in batches}
    assert tokens == {"one", "div16", "other"} and seqs == {"one", "div16", "other"}
    assert any(s > 0 for b in batches for s, _ in b)  # continued sequences (attention over a cached prefix)
    for batch in batches:
        assert sum(n for _, n in batch) <= 8192 and len(batch) <= 256
        assert all(s + n <= 262144 and n >= 1 for s, n in batch)
    small = StepShapes(decode_buckets=[1, 2], graph_ctx_cap=64, decode_hint=True, max_batch_tokens=64,
                       max_running=2, max_model_len=64, replay=False)
    for batch in prefill_shapes(small):
        assert sum(n for _, n in batch) <= 64 and len(batch) <= 2 and all(s + n <= 64 for s, n in batch)


def test_an_unknown_triton_release_turns_the_precompile_off(monkeypatch):
    import triton

    assert P.supported_triton("3.6.0") and not P.supported_triton("3.7.1")
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    traced = []
    assert P.precompile(lambda: traced.append(1)) is None
    assert traced == []  # nothing traced: every kernel compiles at its first launch
