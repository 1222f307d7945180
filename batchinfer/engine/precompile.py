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

Parts: `triton_specs` (a specialisation: record, decode, compile, cache lookup), `step_shapes`
(what the engine's steps run, and the trace of them), `trace_manifest` (a trace's result kept
beside the Triton cache: a start-up whose trace is on record traces nothing).
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from batchinfer.engine import trace_manifest
from batchinfer.engine.triton_specs import (
    SUPPORTED_TRITON, KernelSpecialisation, _jit_function, build_launcher, compile_specialisation,
    current_target, is_cached, settle_cache_keys, supported_triton, trace_specialisations)

log = logging.getLogger(__name__)
ENV_WORKERS = "BATCHINFER_PRECOMPILE"
MAX_WORKERS = 16


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
    not know). `spare_cpus`: CPUs the caller keeps busy meanwhile. A `trace` with a `key`
    (`step_shapes.EngineTrace`) is traced once per key: later calls read what it launches from
    the trace manifest (`trace_manifest`) and trace nothing."""
    if worker_count(1) == 0:
        return None
    if not supported_triton():
        log.info("no up-front compile on triton %s (supported: %s); kernels compile at first launch",
                 __import__("triton").__version__, ", ".join(SUPPORTED_TRITON))
        return None
    start = time.monotonic()
    settle_cache_keys()  # before the trace hashes any kernel, as every worker does
    key = getattr(trace, "key", None)
    specs = trace_manifest.read(key) if key is not None else None
    if specs is None:
        specs = trace_specialisations(trace)
        if key is not None:
            trace_manifest.write(key, specs)
    else:
        log.info("Triton kernels: %d from the trace manifest (no trace)", len(specs))
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
