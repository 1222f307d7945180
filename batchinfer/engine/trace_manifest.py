"""What a precompile trace found, kept beside the Triton cache so a later start-up skips the trace.

The trace (`precompile.start_precompile`) runs every step shape of the engine through the model
to learn which kernel specialisations the steps launch: seconds at the 27B shapes, even when
every one of them is already compiled. Its result depends only on the code (batchinfer's
sources, the Triton and torch releases), the device, and what the engine runs (the model's
config, the dtype, the step shapes, the pools' per-slot shapes); `trace_key` hashes those, and
`<triton cache>/batchinfer-traces/<key>.json` holds the specialisations traced under that key.
A hit replaces the trace; a damaged, stale or foreign manifest is ignored (the trace runs and
rewrites it). A manifest that misses a kernel only leaves it to compile at its first launch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

from batchinfer.engine.triton_specs import KernelSpecialisation

log = logging.getLogger(__name__)
VERSION = 1
DIR_NAME = "batchinfer-traces"
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # batchinfer/
_source_digest: Optional[str] = None


def source_digest(root: Path = _PACKAGE_ROOT) -> str:
    """sha256 over batchinfer's Python sources (paths and bytes): kernels and the code that picks
    them. Computed once per process (a few ms)."""
    global _source_digest
    if _source_digest is not None and root == _PACKAGE_ROOT:
        return _source_digest
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    value = digest.hexdigest()
    if root == _PACKAGE_ROOT:
        _source_digest = value
    return value


def _environment() -> list[str]:
    # Switches that change which kernels run or how triton compiles them.
    return sorted(f"{k}={v}" for k, v in os.environ.items()
                  if k.startswith(("BATCHINFER_", "TRITON_")) and k != "TRITON_CACHE_DIR")


def trace_key(parts: Iterable[object]) -> str:
    """The key of a trace of what `parts` (reprs of what the engine runs) describe, on this code,
    these releases and this environment."""
    import torch
    import triton

    digest = hashlib.sha256()
    for part in [VERSION, source_digest(), triton.__version__, torch.__version__, *_environment(), *parts]:
        digest.update(repr(part).encode() + b"\0")
    return digest.hexdigest()


def manifest_dir() -> Path:
    """Beside the Triton disk cache (TRITON_CACHE_DIR, default ~/.triton/cache)."""
    try:
        import triton

        cache = triton.knobs.cache.dir
    except Exception:  # an older triton: its documented default
        cache = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return Path(cache) / DIR_NAME


def read(key: str, folder: Optional[Path] = None) -> Optional[list[KernelSpecialisation]]:
    """The specialisations recorded under `key`, or None: no manifest, or one that is damaged
    (not JSON, wrong shape) or written for another key (a stale or foreign file)."""
    path = (folder or manifest_dir()) / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["version"] != VERSION or data["key"] != key:
            raise ValueError("another key or version")
        specs = [KernelSpecialisation(*entry) for entry in data["specs"]]
        if not all(isinstance(field, str) for spec in specs for field in
                   (spec.module, spec.name, spec.key, spec.data)):
            raise ValueError("a field that is not text")
        return specs
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.info("trace manifest %s ignored (%s: %s); tracing", path, type(err).__name__, err)
        return None


def write(key: str, specs: Sequence[KernelSpecialisation], folder: Optional[Path] = None) -> None:
    """Record `specs` under `key` (atomically: a temporary file renamed); a failure is only logged."""
    folder = folder or manifest_dir()
    body = json.dumps({"version": VERSION, "key": key,
                       "specs": [[s.module, s.name, s.key, s.data] for s in specs]})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".", suffix=".tmp", delete=False,
                                         encoding="utf-8") as tmp:
            tmp.write(body)
        os.replace(tmp.name, folder / f"{key}.json")
    except OSError as err:  # a read-only cache: the next start-up traces again
        log.info("trace manifest not written to %s: %s", folder, err)
