"""Triton specialisations: what one kernel launch would compile, recorded, decoded, compiled
without a device and looked up in the disk cache. The triton internals the precompile relies
on (the cache hook's arguments, the specialisation data, `JITFunction.run`) live here.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from typing import Callable, Optional

@dataclass(frozen=True)
class KernelSpecialisation:
    module: str   # the kernel's module, importable by name
    name: str     # its qualified name there (a module-level @triton.jit function)
    key: str      # triton's in-memory cache key of the specialisation
    data: str     # triton's serialised specialisation (what `JITFunction.preload` takes)


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
