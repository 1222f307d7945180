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
from batchinfer.engine.precompile import worker_count
from batchinfer.engine.step_shapes import StepShapes, prefill_shapes

REPO = Path(__file__).resolve().parents[2]

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


# The launcher stub (C, built with the system compiler) links libcuda: a stand-in with the
# symbols it references lets it build and load on a machine without a GPU driver.
FAKE_LIBCUDA = "".join(f"int {name}(void) {{ return 0; }}\n" for name in (
    "cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuFuncSetAttribute",
    "cuGetErrorString", "cuPointerGetAttribute"))

LAUNCHER_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import triton.runtime.build as build
    from triton.backends.nvidia.driver import CudaLauncher
    from batchinfer.engine import precompile as P
    from batchinfer.kernels.rmsnorm import rmsnorm

    signature = {name: "*bf16" for name in ("x_ptr", "delta_ptr", "w_ptr", "sum_ptr", "out_ptr")}
    signature.update({name: "i32" for name in ("stride_x", "stride_delta", "stride_sum", "stride_out", "N")})
    signature.update(eps="fp32", BLOCK_N="constexpr")
    data = json.dumps({"name": "add_rms_norm_kernel", "signature": signature, "constant_keys": [[11]],
                       "constant_vals": [1024], "attrs_keys": [[i] for i in range(10)],
                       "attrs_vals": [[["tt.divisibility", 16]]] * 10, "options": {"num_warps": 4}, "key": "k"})
    spec = P.KernelSpecialisation("batchinfer.kernels.rmsnorm.rmsnorm", "add_rms_norm_kernel", "k", data)
    target = ("cuda", 90, 32)
    compiled = P.compile_all([spec], workers=1, target=target)
    launchers = sorted(p.name for p in Path(sys.argv[1]).rglob("__triton_launcher*"))

    def no_compiler(*args, **kwargs):
        raise AssertionError("the launcher was not in the cache: the C compiler was called")

    build._build = no_compiler  # what the first launch in this process would do: a cache hit only
    CudaLauncher(*(lambda k: (k.src, k.metadata))(P.compile_specialisation(spec, target)))
    print(json.dumps({"compiled": compiled, "launchers": launchers}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not P.supported_triton(), reason="the launcher build uses triton 3.6 internals")
def test_workers_build_the_launcher_the_first_launch_would_build(tmp_path):
    stub = tmp_path / "libcuda"
    stub.mkdir()
    (stub / "stub.c").write_text(FAKE_LIBCUDA)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(stub / "libcuda.so.1"), str(stub / "stub.c")], check=True)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "TRITON_LIBCUDA_PATH": str(stub),
           "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(stub), os.environ.get("LD_LIBRARY_PATH")])),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", LAUNCHER_SCRIPT, str(tmp_path / "cache")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert result["compiled"] == 1
    assert len(result["launchers"]) == 1  # built by the worker, found by this process's CudaLauncher


def _fake_specs(n: int) -> list:
    return [P.KernelSpecialisation("batchinfer.kernels.rmsnorm.rmsnorm", "add_rms_norm_kernel", f"k{i}", "{}")
            for i in range(n)]


def test_start_precompile_returns_while_the_compiles_run(monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    released = threading.Event()
    events = []

    def compile_in_worker(spec, target):  # blocks until the caller's own work (the load) is done
        return (None, None) if released.wait(timeout=10) else ("TimeoutError: start waited for me", None)

    monkeypatch.setattr(P, "supported_triton", lambda version=None: True)
    monkeypatch.setattr(P, "trace_specialisations", lambda trace: _fake_specs(3))
    monkeypatch.setattr(P, "current_target", lambda: ("cuda", 90, 32))
    monkeypatch.setattr(P, "_cached_or_unknown", lambda spec, target: spec.key == "k0")
    monkeypatch.setattr(P, "_compile_in_worker", compile_in_worker)
    monkeypatch.setattr(P, "load_all", lambda specs: events.append(("load_all", [s.key for s in specs])))
    monkeypatch.setenv("BATCHINFER_PRECOMPILE", "4")
    pending = P.start_precompile(lambda: None, executor=ThreadPoolExecutor(2))
    assert pending.compiling and pending.missing == 2 and pending.workers == 2
    events.append("caller's work")
    released.set()
    report = pending.finish()
    assert events == ["caller's work", ("load_all", ["k0", "k1", "k2"])]  # every traced one, cached or not
    assert (report.kernels, report.missing, report.compiled) == (3, 2, 2)
    assert report.wait_seconds <= report.compile_seconds + 1e-3
    assert pending.finish() is report  # once


def test_worker_count_leaves_spare_cpus(monkeypatch):
    monkeypatch.delenv("BATCHINFER_PRECOMPILE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert worker_count(100) == 16 and worker_count(100, spare_cpus=1) == 15
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert worker_count(100, spare_cpus=1) == 1  # never none by default
    monkeypatch.setenv("BATCHINFER_PRECOMPILE", "16")
    assert worker_count(100, spare_cpus=1) == 16  # an explicit count is taken as it is


def test_cancel_ends_the_worker_processes(tmp_path, monkeypatch):
    """A start-up that fails while the workers compile (a bad checkpoint) does not wait for them:
    here each compile hangs (its kernel module sleeps when a worker imports it)."""
    import time

    (tmp_path / "hanging_kernel.py").write_text(
        "import multiprocessing, time\nif multiprocessing.parent_process() is not None:\n    time.sleep(120)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get this process's sys.path
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    specs = [P.KernelSpecialisation("hanging_kernel", "kernel", f"k{i}", "{}") for i in range(2)]
    jobs = P.CompileJobs(specs, workers=2, target=("cuda", 90, 32))
    workers = list(jobs._pool._processes.values())
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    start = time.monotonic()
    jobs.cancel()
    # The executor's own thread reaps the workers too: while it holds a reaped one's exit status,
    # is_alive() here reads True (waitpid fails), so poll until the deadline instead of once.
    while any(w.is_alive() for w in workers) and time.monotonic() - start < 20:
        time.sleep(0.05)
    assert not any(w.is_alive() for w in workers) and time.monotonic() - start < 20


def test_a_trace_on_record_is_not_traced_again(tmp_path, monkeypatch):
    """The trace manifest: the second start-up with the same key reads the specialisations and
    traces nothing; a damaged manifest or another key traces again (and nothing is lost)."""
    from batchinfer.engine import trace_manifest
    from batchinfer.engine.step_shapes import EngineTrace

    traces = []
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHINFER_PRECOMPILE", "1")
    monkeypatch.setattr(P, "supported_triton", lambda version=None: True)
    monkeypatch.setattr(P, "trace_specialisations", lambda trace: traces.append(trace.key) or _fake_specs(3))
    monkeypatch.setattr(P, "current_target", lambda: ("cuda", 90, 32))
    monkeypatch.setattr(P, "_cached_or_unknown", lambda spec, target: True)  # a warm compile cache
    monkeypatch.setattr(P, "load_all", lambda specs: None)

    def start(key: str):
        pending = P.start_precompile(EngineTrace(lambda: None, key))
        assert not pending.compiling
        return [s.key for s in pending.specs]

    assert start("a") == ["k0", "k1", "k2"] and traces == ["a"]
    assert start("a") == ["k0", "k1", "k2"] and traces == ["a"]  # on record: no trace
    assert start("b") == ["k0", "k1", "k2"] and traces == ["a", "b"]  # another model or shape: traced
    manifest = trace_manifest.manifest_dir() / "a.json"
    assert manifest.parent == tmp_path / "cache" / trace_manifest.DIR_NAME
    for damage in ("{not json", '{"version": 1, "key": "other", "specs": []}', '{"version": 1, "key": "a", "specs": [[1]]}'):
        manifest.write_text(damage)
        assert start("a") == ["k0", "k1", "k2"] and traces[-1] == "a"  # ignored: traced and rewritten
    assert len(traces) == 5 and start("a") and len(traces) == 5
