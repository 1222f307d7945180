"""Compile the Triton kernels an engine will launch up front, in parallel processes.

A fresh machine otherwise compiles each kernel specialisation the first time it is launched,
one after another in the engine's thread (tens of seconds for the GDN-hybrid kernels). Here:

1. trace: the model runs the engine's step shapes (every decode-graph bucket, a set of prefill
   batches that cover the integer classes Triton specialises on: 1, divisible by 16, other, and
   mixed steps' eager decode rows in the same classes) on
   the pools' scratch slots with every Triton launch turned into a warm-up (no kernel runs) and
   triton's `jit_cache_hook` answering "skip" (nothing compiles); each launch that would have
   compiled is recorded as its specialisation data (torch ops run, on garbage: shapes only);
2. compile: worker processes (spawned, no CUDA: `triton.compile` for the device's target) compile
   the recorded specialisations the on-disk cache (TRITON_CACHE_DIR) lacks into it, largest
   first (a warm cache starts no worker), and build each one's launcher (the C stub triton
   otherwise builds with the C compiler at the kernel's first launch, one after another);
3. load: this process `preload`s each one (a cache hit), so later launches find them in memory.

`start_precompile` returns once the compiles are submitted (`PendingPrecompile.finish` waits
and loads), so the engine loads the weights (one disk-bound thread) while the workers compile;
`precompile` does both in one call.

Anything the trace misses still compiles lazily at its first launch, as before: the result is
only ever faster, never different. A worker failure is logged and left to that lazy compile.
`BATCHINFER_PRECOMPILE=0` turns it off; `=N` uses N worker processes (default: one per CPU, ≤ 16).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)
ENV_WORKERS = "BATCHINFER_PRECOMPILE"
MAX_WORKERS = 16


@dataclass(frozen=True)
class KernelSpecialisation:
    module: str   # the kernel's module, importable by name
    name: str     # its qualified name there (a module-level @triton.jit function)
    key: str      # triton's in-memory cache key of the specialisation
    data: str     # triton's serialised specialisation (what `JITFunction.preload` takes)


@dataclass(frozen=True)
class PrecompileReport:
    kernels: int          # specialisations traced
    missing: int          # of them not in the disk cache
    compiled: int         # of those compiled by the workers (the rest failed there: they compile lazily)
    workers: int
    trace_seconds: float
    compile_seconds: float  # submit → last worker done (wall clock; the weights may load meanwhile)
    load_seconds: float
    wait_seconds: float = 0.0  # of compile_seconds, what `finish` waited (after the caller's own work)


def worker_count(specs: int, spare_cpus: int = 0) -> int:
    """Worker processes to use: BATCHINFER_PRECOMPILE (0 = off), else one per CPU up to MAX_WORKERS,
    leaving `spare_cpus` to the caller's own work (e.g. a weight load running meanwhile)."""
    raw = os.environ.get(ENV_WORKERS, "").strip()
    if raw:
        try:
            wanted = int(raw)
        except ValueError:
            raise ValueError(f"{ENV_WORKERS} must be a whole number of worker processes, not {raw!r}") from None
    else:
        wanted = max(1, min((os.cpu_count() or 1) - spare_cpus, MAX_WORKERS))
    return max(0, min(wanted, specs))


def trace_specialisations(run: Callable[[], None]) -> list[KernelSpecialisation]:
    """Call `run` with every Triton launch that would compile recorded and skipped (neither
    compiled nor launched); the distinct specialisations in first-seen order."""
    import triton

    seen: dict[tuple[str, str, str], KernelSpecialisation] = {}

    def record(*, key, fn, compile, **_: object) -> bool:
        module = fn.module if isinstance(fn.module, str) else fn.module.__name__
        spec = KernelSpecialisation(module, fn.name, str(key), compile["specialization_data"])
        seen.setdefault((spec.module, spec.name, spec.key), spec)
        return True  # triton then skips the compile, and the launch

    from triton.runtime.jit import JITFunction

    launch = JITFunction.run

    def without_launch(self, *args, grid, warmup, **kwargs):
        # warmup=True: triton finds or compiles the kernel but launches nothing, so no kernel
        # compiled earlier runs on the outputs of one the trace skipped.
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = record
    JITFunction.run = without_launch
    try:
        run()
    finally:
        JITFunction.run = launch
        triton.knobs.runtime.jit_cache_hook = previous
    return list(seen.values())


def _jit_function(spec: KernelSpecialisation):
    return getattr(importlib.import_module(spec.module), spec.name)


def _decode(spec: KernelSpecialisation, target: tuple):
    """`JITFunction.preload`'s decoding of a specialisation: (source, target, options) as
    `triton.compile` takes them."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    fn = _jit_function(spec)
    obj = json.loads(spec.data)
    constexprs = {
        tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value) else
        tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
        for key, value in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {key: convert_to_tuple_if_list(value) for key, value in obj["signature"].items()}
    options = {key: tuple(value) if isinstance(value, list) else value for key, value in obj["options"].items()}
    gpu_target = GPUTarget(*target)
    options = make_backend(gpu_target).parse_options(options)
    return ASTSource(fn, signature, constexprs, attrs), gpu_target, options


def compile_specialisation(spec: KernelSpecialisation, target: tuple):
    """Compile one specialisation for `target` (backend, arch, warp size) into the disk cache,
    without a device: the `triton.compile` call `JITFunction.preload` would make; → the kernel."""
    import triton

    src, gpu_target, options = _decode(spec, target)
    return triton.compile(src, target=gpu_target, options=options.__dict__)


def build_launcher(kernel) -> None:
    """The C launcher of a compiled kernel into the disk cache, without a device: triton builds
    it (C compiler, ~0.5 s) at the kernel's first launch unless the cache holds one for the same
    signature and constants. `CudaLauncher` is what `CompiledKernel._init_handles` constructs;
    the module it loads links libcuda but initialises nothing."""
    from triton.backends.nvidia.driver import CudaLauncher

    CudaLauncher(kernel.src, kernel.metadata)


def is_cached(spec: KernelSpecialisation, target: tuple) -> bool:
    """Whether the disk cache already holds the specialisation (`triton.compile`'s own lookup)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    src, gpu_target, options = _decode(spec, target)
    backend = make_backend(gpu_target)
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
    return group.get(name) is not None


KERNEL_PACKAGE = "batchinfer.kernels"
_settled = False


def settle_cache_keys(package: str = KERNEL_PACKAGE) -> int:
    """Compute the cache key of every @triton.jit function under `package` now, in one fixed
    order (module, then name); → how many. Triton 3.6 folds a called helper's global values into
    a kernel's key only when the helper's own key was computed first, so a kernel's key depends on
    which kernels sharing its helpers were hashed before it in the process: a worker that compiles
    `_shared_prefix_kernel` first files it under another key than an engine that hashed
    `_attn_decode_split_kernel` first, and the engine compiles it again. Settled the same way in
    both processes, the keys agree."""
    global _settled
    if _settled:
        return 0
    import pkgutil

    from triton.runtime.jit import JITFunction

    root = importlib.import_module(package)
    names = sorted([package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")])
    count = 0
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # an optional kernel module that cannot import here: nothing of it runs
            continue
        for attr in sorted(vars(module)):
            fn = getattr(module, attr)
            if isinstance(fn, JITFunction) and fn.__module__ == name:
                fn.cache_key  # noqa: B018 (computed and memoised)
                count += 1
    _settled = True
    return count


def _compile_in_worker(spec: KernelSpecialisation, target: tuple) -> tuple[Optional[str], Optional[str]]:
    """(compile error, launcher error), each None when it worked."""
    try:
        settle_cache_keys()
        kernel = compile_specialisation(spec, target)
    except Exception as err:  # reported by the parent; the kernel then compiles at its first launch
        return f"{type(err).__name__}: {err}", None
    if target[0] != "cuda":
        return None, None
    try:
        build_launcher(kernel)
    except Exception as err:  # the launcher is then built at the kernel's first launch, as without this
        return None, f"{type(err).__name__}: {err}"
    return None, None


def _source_size(spec: KernelSpecialisation) -> int:
    try:
        return len(_jit_function(spec).src)
    except Exception:
        return 0


class CompileJobs:
    """`specs` compiling in `workers` spawned processes (longest sources first: they take
    longest), started at construction; `wait()` → the number compiled."""

    def __init__(self, specs: Sequence[KernelSpecialisation], workers: int, target: tuple,
                 executor: Optional[Executor] = None) -> None:
        import multiprocessing

        self.submitted = time.monotonic()
        self.last_done = self.submitted
        self._pool = executor or ProcessPoolExecutor(max_workers=workers,
                                                     mp_context=multiprocessing.get_context("spawn"))
        self._jobs: list[tuple[KernelSpecialisation, Future]] = []
        self.launcher_failures = 0
        for spec in sorted(specs, key=_source_size, reverse=True):
            future = self._pool.submit(_compile_in_worker, spec, target)
            future.add_done_callback(self._done)
            self._jobs.append((spec, future))

    def _done(self, _: Future) -> None:
        self.last_done = max(self.last_done, time.monotonic())

    def cancel(self) -> None:
        """Stop: compiles not started are dropped and the workers ended (otherwise the process
        would wait for the running compiles at exit). The disk cache stays consistent: triton
        writes each entry to a temporary file and renames it."""
        if hasattr(self._pool, "terminate_workers"):  # Python 3.14+
            self._pool.terminate_workers()
            return
        workers = list((getattr(self._pool, "_processes", None) or {}).values())  # no public handle before 3.14
        self._pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.terminate()
        for worker in workers:  # a worker caught where SIGTERM is held off is killed
            worker.join(timeout=2)
            if worker.is_alive():
                worker.kill()

    def wait(self) -> int:
        compiled = 0
        try:
            for spec, future in self._jobs:
                try:
                    error, launcher_error = future.result()
                except Exception as err:  # a worker died (e.g. out of memory): the rest compile lazily
                    error, launcher_error = f"{type(err).__name__}: {err}", None
                if error is None:
                    compiled += 1
                else:
                    log.warning("precompile of %s.%s failed (it compiles at its first launch): %s",
                                spec.module, spec.name, error)
                if launcher_error is not None:
                    self.launcher_failures += 1
                    log.info("launcher of %s.%s not prebuilt (built at its first launch): %s",
                             spec.module, spec.name, launcher_error)
        finally:
            self._pool.shutdown()
        return compiled


def compile_all(specs: Sequence[KernelSpecialisation], workers: int, target: tuple) -> int:
    """Compile `specs` over `workers` spawned processes; the number compiled."""
    return CompileJobs(specs, workers, target).wait()


def load_all(specs: Sequence[KernelSpecialisation]) -> None:
    """Each specialisation into its kernel's in-memory cache (from the disk cache the workers filled)."""
    for spec in specs:
        fn = _jit_function(spec)
        try:
            fn.preload(spec.data)
        except Exception as err:
            log.warning("loading precompiled %s.%s failed (it compiles at its first launch): %s",
                        spec.module, spec.name, err)


def _cached_or_unknown(spec: KernelSpecialisation, target: tuple) -> bool:
    try:
        return is_cached(spec, target)
    except Exception:  # triton internals moved: compile it (a cache hit there costs little)
        return False


def current_target() -> tuple:
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


# The trace and the workers use triton internals (the cache hook's arguments, the
# specialisation data, JITFunction.run) as they are in these releases; on others the engine
# compiles each kernel at its first launch, as without the precompile.
SUPPORTED_TRITON = ("3.6.",)


def supported_triton(version: Optional[str] = None) -> bool:
    import triton

    return (version or triton.__version__).startswith(SUPPORTED_TRITON)


class PendingPrecompile:
    """A trace whose compiles run in worker processes; `finish()` waits for them and loads every
    specialisation into this process (once)."""

    def __init__(self, specs: list[KernelSpecialisation], missing: int, workers: int,
                 jobs: Optional[CompileJobs], trace_seconds: float) -> None:
        self.specs, self.missing, self.workers, self.trace_seconds = specs, missing, workers, trace_seconds
        self._jobs = jobs
        self._report: Optional[PrecompileReport] = None

    @property
    def compiling(self) -> bool:
        """Whether worker processes were started (a warm cache starts none)."""
        return self._jobs is not None

    def cancel(self) -> None:
        """Give up (the caller failed meanwhile): nothing more is compiled or loaded."""
        if self._jobs is not None and self._report is None:
            self._jobs.cancel()
            self._jobs = None

    def finish(self) -> PrecompileReport:
        if self._report is not None:
            return self._report
        waiting = time.monotonic()
        compiled = self._jobs.wait() if self._jobs is not None else 0
        built = time.monotonic()
        compile_seconds = self._jobs.last_done - self._jobs.submitted if self._jobs is not None else 0.0
        load_all(self.specs)
        self._report = report = PrecompileReport(
            len(self.specs), self.missing, compiled, self.workers, self.trace_seconds, compile_seconds,
            time.monotonic() - built, built - waiting)
        log.info("Triton kernels: %d traced, %d compiled by %d workers; trace %.1f s, compile %.1f s "
                 "(%.1f s of it waited for), load %.1f s", report.kernels, report.compiled, report.workers,
                 report.trace_seconds, report.compile_seconds, report.wait_seconds, report.load_seconds)
        return report


def start_precompile(trace: Callable[[], None], spare_cpus: int = 0,
                     executor: Optional[Executor] = None) -> Optional[PendingPrecompile]:
    """Trace `trace`'s launches and submit what the disk cache lacks to worker processes (or
    `executor`), without waiting for them (None: turned off, or a triton release the trace does
    not know). `spare_cpus`: CPUs the caller keeps busy meanwhile."""
    if worker_count(1) == 0:
        return None
    if not supported_triton():
        log.info("no up-front compile on triton %s (supported: %s); kernels compile at first launch",
                 __import__("triton").__version__, ", ".join(SUPPORTED_TRITON))
        return None
    start = time.monotonic()
    settle_cache_keys()  # before the trace hashes any kernel, as every worker does
    specs = trace_specialisations(trace)
    traced = time.monotonic()
    target = current_target()
    missing = [spec for spec in specs if not _cached_or_unknown(spec, target)]
    workers = worker_count(len(missing), spare_cpus)  # a warm cache: no worker is started
    jobs = CompileJobs(missing, workers, target, executor) if workers else None
    return PendingPrecompile(specs, len(missing), workers, jobs, traced - start)


def precompile(trace: Callable[[], None]) -> Optional[PrecompileReport]:
    """Trace `trace`'s launches, compile what they need in parallel, load it (None: turned off,
    or a triton release the trace does not know)."""
    pending = start_precompile(trace)
    return None if pending is None else pending.finish()


# ---- the engine's step shapes ------------------------------------------------------------------


@dataclass(frozen=True)
class StepShapes:
    """What the engine will run: its decode-graph buckets and limits."""

    decode_buckets: Sequence[int]   # batch sizes of the decode graphs (or of eager decode steps)
    graph_ctx_cap: int              # context slots per row in the decode graphs' buffers
    decode_hint: bool               # decode steps pass shared_with_prev (the graphs do)
    max_batch_tokens: int
    max_running: int
    max_model_len: int
    replay: bool
    mixed_step: bool = False        # steps with prefill also carry the decode rows (eager decode kernels)


def prefill_shapes(shapes: StepShapes) -> list[list[tuple[int, int]]]:
    """Prefill batches as [(start, new tokens)] per sequence: the token count T and sequence count
    B each 1, a multiple of 16 and neither, fresh and continued sequences, the largest step."""
    most = max(2, min(shapes.max_batch_tokens, shapes.max_model_len - 1))
    cont = min(2048, shapes.max_model_len - most - 1) if shapes.max_model_len - most > 1 else 0
    many = max(1, min(shapes.max_running, most // 3))
    mixed = [(0, 1), (cont, 17), (0, 100), (cont, 300), (0, 5), (cont, 64), (0, 129)]
    batches = [
        [(0, most)],                                   # the largest fresh step
        [(cont, most - 1)],                            # a continued long prompt, T not a multiple of 16
        [(cont, 1)],                                   # a single token after a cached prefix
        [(cont, 128)] * min(32, many),                 # questions after a shared document
        [(0, most - 2), (cont, 2)],                    # a long prompt with a short one
        [(0, 3)] * many,                               # many short prompts
        [(s, min(n, most)) for s, n in mixed if s + n < shapes.max_model_len],
    ]
    batches = [[(s, n) for s, n in batch if n >= 1][:shapes.max_running] for batch in batches]
    return [batch for batch in batches if batch and sum(n for _, n in batch) <= most]


def mixed_decode_sizes(shapes: StepShapes) -> list[int]:
    """Decode rows of traced mixed steps: they run eagerly at any count, so one of each integer
    class (1, a multiple of 16, neither) in each of the decode kernels' batch ranges (32, 128)."""
    sizes = [1, 16, 17, 33, 48, 129, 144, shapes.max_running]
    return sorted({b for b in sizes if b <= shapes.max_running})


def engine_trace(model, caches, shapes: StepShapes, pad_state_slot: int, pad_kv_slot: int,
                 device: torch.device) -> Callable[[], None]:
    """The engine's steps on scratch slots only (nothing the pools own is touched)."""
    from batchinfer.engine.model_runner import DecodeRows, SequenceChunk, build_forward_batch, build_mixed_batch
    from batchinfer.models.forward_batch import ForwardBatch

    def decode(b: int) -> None:
        ctx = b * shapes.graph_ctx_cap
        batch = ForwardBatch(
            input_ids=torch.zeros(b, dtype=torch.int64, device=device),
            positions=torch.zeros(b, dtype=torch.int64, device=device),
            cu_seqlens=torch.arange(b + 1, dtype=torch.int32, device=device), is_decode=True,
            state_slots=torch.full((b,), pad_state_slot, dtype=torch.int64, device=device),
            out_kv_slots=torch.full((b,), pad_kv_slot, dtype=torch.int64, device=device),
            kv_indices=torch.full((ctx,), pad_kv_slot, dtype=torch.int64, device=device),
            kv_indptr=torch.arange(b + 1, dtype=torch.int32, device=device),
            logits_indices=torch.arange(b, dtype=torch.int64, device=device), replay=shapes.replay,
            shared_with_prev=torch.zeros(b, dtype=torch.int32, device=device) if shapes.decode_hint else None)
        model.forward(batch, caches)

    def prefill(seqs: list[tuple[int, int]]) -> None:
        chunks = [SequenceChunk(token_ids=[0] * n, start=s, state_slot=pad_state_slot,
                                context_kv=torch.full((s + n,), pad_kv_slot, dtype=torch.int64), wants_logits=True)
                  for s, n in seqs]
        model.forward(build_forward_batch(chunks, is_decode=False, replay=False, device=device), caches)

    def mixed(b: int) -> None:  # a short continued chunk, then b decode rows of one-slot contexts
        chunk = SequenceChunk(token_ids=[0] * 17, start=0, state_slot=pad_state_slot,
                              context_kv=torch.full((17,), pad_kv_slot, dtype=torch.int64), wants_logits=True)
        rows = DecodeRows(token_ids=[0] * b, positions=[0] * b, state_slots=[pad_state_slot] * b,
                          kv_indices=torch.full((b,), pad_kv_slot, dtype=torch.int64),
                          shared_with_prev=[0] * b if shapes.decode_hint else None)
        model.forward(build_mixed_batch([chunk], rows, replay=shapes.replay, device=device), caches)

    def sample(vocab: int) -> None:  # the sampler's draw as the engine dispatches it (the fused kernel: one compile)
        from batchinfer.engine.sampler import _gumbel_argmax
        _gumbel_argmax(torch.zeros(1, vocab, dtype=torch.float32, device=device),
                       torch.zeros(1, 2, dtype=torch.int64, device=device))

    @torch.inference_mode()
    def run() -> None:
        steps = [("decode", b) for b in reversed(list(shapes.decode_buckets))] + \
                [("prefill", seqs) for seqs in prefill_shapes(shapes)] + \
                [("mixed", b) for b in (mixed_decode_sizes(shapes) if shapes.mixed_step else [])]
        for kind, arg in steps:
            try:
                {"decode": decode, "prefill": prefill, "mixed": mixed}[kind](arg)
            except Exception as err:  # a shape the trace cannot run: its kernels compile lazily
                log.warning("precompile trace of a %s step failed: %s: %s", kind, type(err).__name__, err)
        sample(model.config.vocab_size)
        torch.cuda.synchronize(device)

    return run
