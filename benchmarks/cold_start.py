"""Cold start of `batchinfer run`: a fresh machine's first job against the same job run again.

    python -m benchmarks.cold_start                  # H200: qwen3.5-27b shapes, 16 layers, 256-row rag job
    python -m benchmarks.cold_start --quick          # CPU smoke run: tiny preset, fp32, a few rows
    python -m benchmarks.cold_start --json out.json  # also every number as JSON

Setup (skipped when `--folder` already holds it): a random-weight checkpoint of the preset's
shapes with `--layers` layers in bf16 (config.json + model.safetensors, the demo's tokenizer files:
prompts are token ids, the tokenizer only decodes), a rag job of `--rows` rows (documents of 2048
random tokens, each shared by 32 questions of 128; `ignore_eos`, `--output-tokens` each).

Then the job runs twice in a row as `python -m batchinfer run jobs.yaml --overwrite` child
processes (each wrapped by `--child`, which times phases from inside and changes nothing else):
the first with TRITON_CACHE_DIR an empty new folder (a fresh machine: every Triton kernel
compiles) and the checkpoint dropped from the page cache (`--cold-libraries`: also every file
of the Python environment — torch's and the CUDA libraries' kernels — as on a fresh machine),
the second with the same cache folder and warm files. Per run: the process's wall time and its
phases — interpreter start and imports, job preparation (tokenising), model allocation, engine
set-up (pools; of it the kernel trace, the weight load while the kernels compile in worker
processes, the wait for the compiles left, CUDA-graph capture), planning, generation — and per
phase (attributed to the innermost open one):
- Triton compiles (count and seconds, from triton's `jit_cache_hook` / `jit_post_compile_hook`:
  the time between them is the compile, or the load from the compile cache; after the
  precompile's wait a compile is a lazy one the trace missed);
- launcher builds (triton's C stub, built with the C compiler when the cache lacks it: the
  precompile workers build them, so a run should show none after the wait);
- first launches (`CompiledKernel._init_handles`: the launcher and the module loaded onto the GPU);
- major page faults and bytes read from disk by this process (`getrusage`, /proc/self/io): a
  cold page cache of the CUDA libraries shows here, in the phase whose first kernels load them.
For the first run also every compile (kernel, constexprs and specialisation, seconds), slowest
first, and the precompile's own report (workers, compile wall time, the part waited for).

Last, in a separate child process, the checkpoint load (`load_model` onto the device) from a cold
page cache (each shard fsynced and dropped with `posix_fadvise(DONTNEED)`; needs no root, but the
kernel may keep pages: reported when the drop did not take, judged by the sequential read rate) and
from a warm one, against the file bytes and a plain sequential read of the same files (16 MiB
`readinto`) cold and warm.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

_T0 = time.time()  # the child's first instant after the interpreter reached this module
REPO_ROOT = Path(__file__).resolve().parents[1]
SPAWN_ENV = "BATCHINFER_COLD_START_SPAWN"  # the parent's time.time() just before it spawned the child
READ_CHUNK = 16 << 20

# ---------------------------------------------------------------- child: phases from inside a run


def io_counters() -> dict[str, Optional[int]]:
    """This process's major page faults and bytes read from storage so far (None: unknown)."""
    import resource

    read_bytes = None
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                read_bytes = int(line.split()[1])
    except OSError:
        pass
    return {"major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt, "read_bytes": read_bytes}


class Timeline:
    """Phases (nested intervals) and Triton compiles, launcher builds and first launches of one
    process, in time.time() seconds."""

    def __init__(self, counters: Callable[[], dict[str, Optional[int]]] = io_counters) -> None:
        self.phases: list[dict[str, Any]] = []
        self.compiles: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # launcher builds, first launches: kind, seconds, phase
        self.records: dict[str, Any] = {}
        self._open: list[dict[str, Any]] = []
        self._compile_start: Optional[tuple[float, str]] = None
        self._counters = counters

    def phase(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            entry = {"name": name, "start": time.time(), "end": None, "io_start": self._counters()}
            self.phases.append(entry)
            self._open.append(entry)
            try:
                return fn(*args, **kwargs)
            finally:
                _sync_cuda()
                entry["end"] = time.time()
                end = self._counters()
                entry["io"] = {k: None if v is None or entry["io_start"].get(k) is None else v - entry["io_start"][k]
                               for k, v in end.items()}
                self._open.remove(entry)
        timed.__wrapped__ = fn
        return timed

    def event(self, kind: str, fn: Callable) -> Callable:
        """`fn` timed as one `kind` event of the innermost open phase."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, phase = time.time(), self.innermost()
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append({"kind": kind, "seconds": time.time() - start, "phase": phase})
        timed.__wrapped__ = fn
        return timed

    def keep(self, name: str, fn: Callable, what: Callable[[Any], Any]) -> Callable:
        """`fn`, with `what(result)` kept under records[name]."""
        def kept(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            try:
                self.records[name] = what(result)
            except Exception as err:  # a record is diagnostics only
                self.records[name] = f"unavailable: {err}"
            return result
        kept.__wrapped__ = fn
        return kept

    def innermost(self) -> str:
        return self._open[-1]["name"] if self._open else "other"

    # triton calls these with keyword arguments (key, repr, fn, compile, is_manual_warmup, already_compiled)
    def before_compile(self, **kwargs: Any) -> None:
        self._compile_start = (time.time(), self.innermost())
        return None  # a true value would make triton skip the compile

    def after_compile(self, **kwargs: Any) -> None:
        end = time.time()
        start, phase = self._compile_start or (end, self.innermost())
        self._compile_start = None
        fn = kwargs.get("fn")
        compile_info = kwargs.get("compile") or {}
        self.compiles.append({
            "kernel": f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}",
            "constexprs": _named_constexprs(getattr(fn, "jit_function", None), compile_info.get("constants") or {}),
            "repr": kwargs.get("repr", ""),
            "seconds": end - start, "start": start, "phase": phase})
        return None


def _named_constexprs(jit_function: Any, constants: dict) -> dict[str, Any]:
    """triton keys constexprs by argument path ((index,) for a plain argument): → parameter names.
    Integer arguments equal to 1 appear here too (triton specialises them as constants)."""
    names = [p.name for p in getattr(jit_function, "params", [])]
    out = {}
    for path, value in constants.items():
        index = path[0] if isinstance(path, tuple) and path else path
        name = names[index] if isinstance(index, int) and index < len(names) else str(path)
        out[name if len(path) <= 1 else f"{name}{list(path[1:])}"] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)


def _sync_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _patch(timeline: Timeline, owner: Any, attr: str, name: str) -> None:
    import inspect

    raw = inspect.getattr_static(owner, attr)
    if isinstance(raw, classmethod):
        setattr(owner, attr, classmethod(timeline.phase(name, raw.__func__)))
    elif isinstance(raw, staticmethod):
        setattr(owner, attr, staticmethod(timeline.phase(name, raw.__func__)))
    else:
        setattr(owner, attr, timeline.phase(name, raw))


def child_main(out_path: Path, cli_args: list[str]) -> int:
    """Run the batchinfer CLI in this process with phase timers; write the timeline to `out_path`."""
    spawn = float(os.environ.get(SPAWN_ENV, _T0))
    timeline = Timeline()
    imports_start, imports_io = time.time(), io_counters()
    import torch  # noqa: F401  (timed: the imports a run pays before any work)
    import triton

    import triton.compiler.compiler as triton_compiler
    import triton.runtime.build as triton_build

    import batchinfer.cli as cli
    import batchinfer.engine.cuda_graphs as cuda_graphs
    import batchinfer.engine.engine as engine_module
    try:  # where the engine's building lives (EngineBuilder); older trees build inside Engine
        import batchinfer.engine.build as build_module
    except ImportError:
        build_module = None
    import batchinfer.engine.precompile as precompile
    import batchinfer.models.loader as loader
    import batchinfer.models.presets as presets
    import batchinfer.jobs.run.in_process as in_process
    import batchinfer.jobs.run.runner as runner
    imports_end = time.time()
    timeline.phases.append({"name": "imports", "start": imports_start, "end": imports_end, "io": {
        k: None if v is None or imports_io.get(k) is None else v - imports_io[k] for k, v in io_counters().items()}})

    triton.knobs.runtime.jit_cache_hook = timeline.before_compile
    triton.knobs.runtime.jit_post_compile_hook = timeline.after_compile
    # The C compiler run for a launcher the cache lacks, and a kernel's first launch in a process.
    triton_build._build = timeline.event("launcher_build", triton_build._build)
    kernel_class = triton_compiler.CompiledKernel
    kernel_class._init_handles = timeline.event("first_launch", kernel_class._init_handles)
    _patch(timeline, cli, "_prepare_all", "prepare_job")
    import batchinfer.engine.engine_build as engine_build
    # The runner builds through build_engine (beside the plan), which calls from_pretrained outside a build.
    _patch(timeline, engine_build, "build_engine", "open_engine")
    _patch(timeline, presets, "load_model", "build_model")  # a load before the engine (no overlap)
    if hasattr(loader, "empty_model"):  # the weights load inside the engine, beside the compile
        _patch(timeline, loader, "empty_model", "allocate_model")
    _patch(timeline, loader, "load_weights", "load_weights")
    _patch(timeline, engine_module.Engine, "__init__", "engine_init")
    _patch(timeline, cuda_graphs.DecodeGraphs, "capture_all", "capture_graphs")
    builds = build_module.EngineBuilder if build_module is not None else engine_module.Engine
    if hasattr(builds, "_start_precompile"):  # trace + submit; the wait comes after the load
        _patch(timeline, builds, "_start_precompile", "precompile")
        finish = timeline.phase("compile_wait", precompile.PendingPrecompile.finish)
        precompile.PendingPrecompile.finish = timeline.keep("precompile_report", finish, lambda r: dict(r.__dict__))
    elif hasattr(engine_module.Engine, "_precompile"):  # trace and compile in one call
        _patch(timeline, engine_module.Engine, "_precompile", "precompile")
    _patch(timeline, runner, "plan_units", "plan")
    _patch(timeline, runner, "prepare_units", "prepare_units")
    _patch(timeline, in_process.InProcessExecutor, "run", "generate")
    code = 0
    try:
        cli.main.main(args=cli_args, prog_name="batchinfer", standalone_mode=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        end = time.time()
        result = {"spawn": spawn, "interpreter_ready": _T0, "imports": [imports_start, imports_end], "end": end,
                  "phases": timeline.phases, "compiles": timeline.compiles, "events": timeline.events,
                  "records": timeline.records, "exit_code": code}
        out_path.write_text(json.dumps(result, indent=1))
    return code


# ---------------------------------------------------------------- child: checkpoint load times


def shard_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def drop_from_page_cache(files: list[Path], sync: bool = True) -> Optional[str]:
    """(fsync +) POSIX_FADV_DONTNEED on each file; None when done, else why not. Pages some
    process has mapped and touched stay."""
    if not hasattr(os, "posix_fadvise"):
        return "os.posix_fadvise not available"
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                if sync:
                    os.fsync(fd)  # dirty pages (a file just written) are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError as err:
        return f"posix_fadvise failed: {err}"
    return None


def environment_files() -> list[Path]:
    """Every regular file of this Python environment's packages (torch, triton, the CUDA
    libraries' wheels, ...): what a fresh machine reads from disk on first use."""
    import sysconfig

    roots = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    files = []
    for root in roots:
        for folder, _, names in os.walk(root):
            files.extend(p for p in (Path(folder) / n for n in names) if p.is_file() and not p.is_symlink())
    return files


def sequential_read_seconds(files: list[Path]) -> float:
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    start = time.monotonic()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.monotonic() - start


def load_child_main(checkpoint: Path, device: str, out_path: Path) -> int:
    import inspect

    import torch

    from batchinfer.models.config import load_model_config
    from batchinfer.models.loader import load_weights
    from batchinfer.models.qwen3_hybrid import HybridModel

    files = shard_files(checkpoint)
    has_modes = "streamed" in inspect.signature(load_weights).parameters  # the loader's two read paths
    size = sum(p.stat().st_size for p in files)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        torch.zeros(1, device=device)  # CUDA initialised outside the timed loads

    def timed_load(streamed: Optional[bool] = None) -> float:
        start = time.monotonic()
        model = HybridModel(load_model_config(checkpoint), dtype, device)
        load_weights(model, checkpoint, **({"streamed": streamed} if has_modes else {}))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.monotonic() - start
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        return seconds

    result: dict[str, Any] = {"file_bytes": size, "files": len(files)}
    result["drop_failed"] = drop_from_page_cache(files)
    result["read_cold_seconds"] = sequential_read_seconds(files)
    result["read_warm_seconds"] = sequential_read_seconds(files)
    result["load_warm_seconds"] = timed_load()
    drop = drop_from_page_cache(files)
    result["drop_failed"] = result["drop_failed"] or drop
    result["load_cold_seconds"] = timed_load()
    if has_modes and device == "cuda":  # the pinned-staging streamed path, for comparison
        result["load_warm_streamed_seconds"] = timed_load(streamed=True)
        drop_from_page_cache(files)
        result["load_cold_streamed_seconds"] = timed_load(streamed=True)
    out_path.write_text(json.dumps(result, indent=1))
    return 0


def write_child_main(checkpoint: Path, config_path: Path, device: str = "cuda") -> int:
    """`write_random_checkpoint`'s names, shapes and init rules, drawn on the GPU (the CPU draw of a
    17 GB checkpoint takes minutes), in bf16."""
    import torch
    from safetensors.torch import save_file

    from batchinfer.models.checkpoint_layout import checkpoint_tensors, default_layout
    from batchinfer.models.config import model_config_from_dict
    from batchinfer.models.random_init import init_random_, make_generator

    raw = json.loads(config_path.read_text())
    config = model_config_from_dict(raw)
    generator = make_generator(0, device)
    tensors = {}
    for spec in checkpoint_tensors(config, default_layout(config)):
        value = torch.empty(spec.shape, dtype=torch.float32, device=device)
        init_random_(value, spec.name, config.num_layers, generator)
        tensors[spec.name] = value.to(torch.bfloat16).cpu()
        del value
    checkpoint.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    (checkpoint / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return 0


# ---------------------------------------------------------------- parent


def child_env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def setup(folder: Path, args: argparse.Namespace) -> Path:
    """Checkpoint, data and jobs.yaml in `folder` (kept when already there); → the job file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import yaml

    from batchinfer.demo import write_demo_tokenizer_files
    from batchinfer.models.checkpoint_writer import write_random_checkpoint
    from batchinfer.models.presets import PRESETS
    from benchmarks.engine_arms import Workload

    checkpoint = folder / "checkpoint"
    config = dict(PRESETS[args.preset])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    if not (checkpoint / "config.json").is_file():
        start = time.monotonic()
        if args.quick:
            write_random_checkpoint(checkpoint, config, dtype=torch.float32)
        else:  # the same tensors drawn on the GPU, in a child so this process holds no CUDA context
            config_path = folder / "checkpoint-config.json"
            config_path.write_text(json.dumps(config))
            subprocess.run([sys.executable, "-m", "benchmarks.cold_start", "--write-child", str(checkpoint),
                            "--child-out", str(config_path)], cwd=REPO_ROOT, env=child_env({}), check=True)
        write_demo_tokenizer_files(checkpoint)
        size = sum(p.stat().st_size for p in shard_files(checkpoint))
        print(f"checkpoint: {args.preset}, {config['num_hidden_layers']} layers, {size / 2**30:.2f} GiB written in "
              f"{time.monotonic() - start:.0f} s", flush=True)
    questions = min(32, args.rows)
    workload = Workload("rag", max(args.rows // questions, 1), questions, args.doc_tokens, args.question_tokens)
    data = folder / "rag.parquet"
    prompts = workload.prompts(int(config["vocab_size"]))
    pq.write_table(pa.table({"ids": pa.array(prompts, pa.list_(pa.int32()))}), data)
    job = {"name": "rag", "model": str(checkpoint), "input": str(data), "prompt": {"token_ids_column": "ids"},
           "sampling": {"max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0.0},
           "engine": {"device": "cpu" if args.quick else "cuda", "dtype": "float32" if args.quick else "bfloat16",
                      "max_running": args.max_running},
           "output": {"path": str(folder / "out")}}
    job_file = folder / "jobs.yaml"
    job_file.write_text(yaml.safe_dump({"jobs": [job]}, sort_keys=False))
    print(f"job: {len(prompts)} rows ({workload.groups} documents of {args.doc_tokens} tokens × {questions} "
          f"questions of {args.question_tokens}), {args.output_tokens} output tokens each", flush=True)
    return job_file


def run_once(folder: Path, job_file: Path, label: str, triton_cache: Path) -> dict[str, Any]:
    timeline_path = folder / f"{label}.timeline.json"
    log_path = folder / f"{label}.log"
    command = [sys.executable, "-m", "benchmarks.cold_start", "--child", str(timeline_path), "--",
               "run", str(job_file), "--overwrite"]
    start = time.time()
    with open(log_path, "w") as log:
        done = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env=child_env({"TRITON_CACHE_DIR": str(triton_cache), SPAWN_ENV: repr(start)}))
    wall = time.time() - start
    if done.returncode != 0 or not timeline_path.is_file():
        tail = log_path.read_text().splitlines()[-20:]
        raise RuntimeError(f"run {label} exited {done.returncode}:\n" + "\n".join(tail))
    timeline = json.loads(timeline_path.read_text())
    stats = json.loads((folder / "out" / "_stats.json").read_text())
    return summarise(label, wall, timeline, stats)


PHASES = ("prepare_job", "allocate_model", "build_model", "engine_init", "precompile", "load_weights",
          "compile_wait", "capture_graphs", "plan", "prepare_units", "generate")
# Where a Triton compile is the precompile's own (a trace skips; the wait preloads from the cache).
PRECOMPILE_PHASES = ("precompile", "compile_wait")


def summarise(label: str, wall: float, timeline: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    phases: dict[str, float] = {}
    io: dict[str, dict[str, Optional[int]]] = {}
    for entry in timeline["phases"]:
        if entry["end"] is not None:
            phases[entry["name"]] = phases.get(entry["name"], 0.0) + entry["end"] - entry["start"]
            for key, value in (entry.get("io") or {}).items():
                seen = io.setdefault(entry["name"], {})
                seen[key] = None if value is None or (key in seen and seen[key] is None) else seen.get(key, 0) + value
    compiles = timeline["compiles"]
    compile_by_phase: dict[str, list[float]] = {}
    for c in compiles:
        compile_by_phase.setdefault(c["phase"], []).append(c["seconds"])
    events: dict[str, dict[str, dict[str, float]]] = {}
    for e in timeline.get("events", []):
        slot = events.setdefault(e["kind"], {}).setdefault(e["phase"], {"count": 0, "seconds": 0.0})
        slot["count"] += 1
        slot["seconds"] += e["seconds"]
    has_precompile = any(p in phases for p in PRECOMPILE_PHASES)
    lazy = [c for c in compiles if c["phase"] not in PRECOMPILE_PHASES] if has_precompile else compiles
    return {
        "run": label, "wall_seconds": wall,
        "process_start_seconds": timeline["interpreter_ready"] - timeline["spawn"],
        "imports_seconds": timeline["imports"][1] - timeline["imports"][0],
        "phases_seconds": phases,
        "compile_count": len(compiles), "compile_seconds": sum(c["seconds"] for c in compiles),
        "compile_by_phase": {k: {"count": len(v), "seconds": sum(v)} for k, v in compile_by_phase.items()},
        "lazy_compiles": len(lazy), "lazy_compile_seconds": sum(c["seconds"] for c in lazy),
        "events_by_phase": events, "io_by_phase": io,
        "precompile_report": (timeline.get("records") or {}).get("precompile_report"),
        "compiles": sorted(({k: c[k] for k in ("kernel", "constexprs", "repr", "seconds", "phase")} for c in compiles),
                           key=lambda c: -c["seconds"]),
        "job_wall_seconds": stats.get("wall_seconds"),
        "output_tokens": stats.get("output_tokens"), "stats": {k: stats.get(k) for k in (
            "startup_seconds", "generation_seconds", "output_tokens_per_second", "cached_tokens", "prompt_tokens")},
    }


def load_times(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = folder / "load.json"
    command = [sys.executable, "-m", "benchmarks.cold_start", "--load-child", str(folder / "checkpoint"),
               "--device", "cpu" if args.quick else "cuda", "--child-out", str(out)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=child_env({}), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"load measurement exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def print_compiles(run: dict[str, Any], top: int) -> None:
    print(f"\nTriton compiles of run {run['run']}: {run['compile_count']} kernels, {run['compile_seconds']:.1f} s "
          f"(slowest {min(top, run['compile_count'])})")
    for c in run["compiles"][:top]:
        constexprs = ", ".join(f"{k}={v}" for k, v in c["constexprs"].items())
        print(f"  {c['seconds']:6.2f} s  {c['phase']:<14} {c['kernel']}  [{constexprs}]")
    by_kernel: dict[str, list[float]] = {}
    for c in run["compiles"]:
        by_kernel.setdefault(c["kernel"], []).append(c["seconds"])
    print("  per kernel (specialisations, seconds):")
    for name, secs in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {len(secs):3d} × {sum(secs):6.2f} s  {name}")


DIAGNOSED_PHASES = ("imports", "prepare_job", "allocate_model", "precompile", "load_weights", "compile_wait",
                    "capture_graphs", "plan", "generate")


def print_phase_diagnostics(runs: list[dict[str, Any]]) -> None:
    """Per phase and run: Triton compiles, launcher builds (C compiler), first launches (module
    loads), major page faults and MiB read by the process (each in the innermost open phase for
    the events; the I/O counters include nested phases)."""
    print(f"\n{'per phase':<16}{'run':>7}{'compiles':>14}{'launcher builds':>17}{'first launches':>17}"
          f"{'major faults':>14}{'MiB read':>10}")

    def cell(slot: Optional[dict]) -> str:
        return "-" if not slot else f"{slot['count']}/{slot['seconds']:.2f}s"

    for phase in DIAGNOSED_PHASES:
        for r in runs:
            events = r.get("events_by_phase", {})
            io = r.get("io_by_phase", {}).get(phase, {})
            compiles = r["compile_by_phase"].get(phase)
            read = io.get("read_bytes")
            print(f"{phase:<16}{r['run']:>7}{cell(compiles):>14}{cell(events.get('launcher_build', {}).get(phase)):>17}"
                  f"{cell(events.get('first_launch', {}).get(phase)):>17}{io.get('major_faults', '-')!s:>14}"
                  f"{'-' if read is None else f'{read / 2**20:.0f}':>10}")


def print_table(runs: list[dict[str, Any]], load: Optional[dict[str, Any]]) -> None:
    print()
    header = f"{'phase (s)':<40}" + "".join(f"{r['run']:>12}" for r in runs)
    print(header)
    print("-" * len(header))

    def row(name: str, values: list[Optional[float]]) -> None:
        print(f"{name:<40}" + "".join(f"{'-' if v is None else f'{v:.2f}':>12}" for v in values))

    row("process wall", [r["wall_seconds"] for r in runs])
    row("  interpreter start", [r["process_start_seconds"] for r in runs])
    row("  imports (torch, triton, batchinfer)", [r["imports_seconds"] for r in runs])
    labels = {"prepare_job": "  prepare job (tokenise)", "allocate_model": "  allocate model (CUDA init)",
              "build_model": "  build model (load before engine)", "engine_init": "  engine init",
              "precompile": "    of it trace + submit compiles", "load_weights": "    of it load weights (compiling)",
              "compile_wait": "    of it wait for compiles + preload", "capture_graphs": "    of it CUDA-graph capture",
              "plan": "  plan", "prepare_units": "  prepare units", "generate": "  generate"}
    for phase in PHASES:
        row(labels[phase], [r["phases_seconds"].get(phase) for r in runs])
    row("Triton compiles or cache loads", [float(r["compile_count"]) for r in runs])
    row("  their seconds", [r["compile_seconds"] for r in runs])
    row("  lazy ones (after the precompile)", [float(r.get("lazy_compiles", 0)) for r in runs])
    row("  their seconds", [r.get("lazy_compile_seconds") for r in runs])
    for r in runs:
        report = r.get("precompile_report")
        if isinstance(report, dict):
            print(f"precompile, run {r['run']}: {report['kernels']} kernels traced, {report['missing']} not cached, "
                  f"{report['compiled']} compiled by {report['workers']} workers in {report['compile_seconds']:.1f} s "
                  f"(wall), {report.get('wait_seconds', 0.0):.1f} s of it waited for after the load")
    print_phase_diagnostics(runs)
    row("job wall (_stats.json)", [r["job_wall_seconds"] for r in runs])
    for name in ("load", "compile_and_capture", "plan"):
        row(f"  startup_seconds.{name}", [(r["stats"].get("startup_seconds") or {}).get(name) for r in runs])
    row("  generation_seconds", [r["stats"].get("generation_seconds") for r in runs])
    if len(runs) == 2:
        print(f"first run − second run: {runs[0]['wall_seconds'] - runs[1]['wall_seconds']:.1f} s")
    if load:
        gib = load["file_bytes"] / 2**30
        print(f"\ncheckpoint load: {gib:.2f} GiB in {load['files']} file(s)"
              + (f"; page-cache drop FAILED ({load['drop_failed']})" if load["drop_failed"] else ""))
        for what in ("read_cold", "read_warm", "load_cold", "load_warm", "load_cold_streamed", "load_warm_streamed"):
            seconds = load.get(f"{what}_seconds")
            if seconds is None:
                continue
            print(f"  {what.replace('_', ' '):<17} {seconds:7.2f} s  {gib / max(seconds, 1e-9):6.2f} GiB/s")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny preset, fp32, few rows")
    parser.add_argument("--preset", default=None, help="model shapes (default qwen3.5-27b; --quick: tiny)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 16; --quick: the preset's)")
    parser.add_argument("--rows", type=int, default=None, help="job rows (default 256; --quick: 16)")
    parser.add_argument("--doc-tokens", type=int, default=None, help="document tokens (default 2048; --quick: 24)")
    parser.add_argument("--question-tokens", type=int, default=None, help="question tokens (default 128; --quick 6)")
    parser.add_argument("--output-tokens", type=int, default=None, help="per row (default 64; --quick: 4)")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--folder", type=Path, default=None, help="work folder (default: a temporary one, deleted)")
    parser.add_argument("--no-load", action="store_true", help="skip the checkpoint load measurement")
    parser.add_argument("--cold-libraries", action="store_true",
                        help="also drop the Python environment's files (torch, CUDA libraries) from the page cache "
                             "before the first run, as on a fresh machine")
    parser.add_argument("--top", type=int, default=40, help="compiles listed for the first run")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--load-child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--write-child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.preset = args.preset or ("tiny" if quick else "qwen3.5-27b")
    args.layers = args.layers if args.layers is not None else (None if quick else 16)
    args.rows = args.rows or (16 if quick else 256)
    args.doc_tokens = args.doc_tokens or (24 if quick else 2048)
    args.question_tokens = args.question_tokens or (6 if quick else 128)
    args.output_tokens = args.output_tokens or (4 if quick else 64)
    if quick:
        args.max_running = min(args.max_running, 8)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--child"]:  # before argparse: the CLI's own arguments follow "--"
        return child_main(Path(raw[1]), raw[3:] if raw[2:3] == ["--"] else raw[2:])
    args = parse_args(raw)
    if args.load_child is not None:
        return load_child_main(args.load_child, args.device, args.child_out)
    if args.write_child is not None:
        return write_child_main(args.write_child, args.child_out, args.device)
    import shutil
    import tempfile

    folder = args.folder or Path(tempfile.mkdtemp(prefix="batchinfer-cold-start-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        job_file = setup(folder, args)
        triton_cache = Path(tempfile.mkdtemp(prefix="triton-cache-", dir=folder))  # empty: a fresh machine
        drop = drop_from_page_cache(shard_files(folder / "checkpoint"))
        print(f"page cache before the first run: {'dropped' if drop is None else drop}", flush=True)
        if args.cold_libraries:
            files = environment_files()
            start = time.monotonic()
            dropped = drop_from_page_cache(files, sync=False)
            print(f"environment files ({len(files)}, {sum(p.stat().st_size for p in files) / 2**30:.1f} GiB): "
                  f"{'dropped' if dropped is None else dropped} in {time.monotonic() - start:.1f} s", flush=True)
        runs = []
        for label in ("first", "second"):
            run = run_once(folder, job_file, label, triton_cache)
            print(f"run {label}: {run['wall_seconds']:.1f} s, {run['compile_count']} Triton compiles "
                  f"({run['compile_seconds']:.1f} s)", flush=True)
            runs.append(run)
        load = None if args.no_load else load_times(folder, args)
        print_compiles(runs[0], args.top)
        if args.json:
            args.json.write_text(json.dumps({"runs": runs, "load": load, "page_cache_drop_failed": drop,
                                             "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
        print_table(runs, load)
        return 0
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
