"""The import graph follows the layers: CLI → jobs → engine ⇄ cache → model → kernels.

A module may import its own layer and any layer below it (skipping layers is fine: jobs → models);
the engine and the cache may import each other; the cache and the model sit side by side under
the engine (the cache owns the pools' tensors, the model reads them through `ModelCaches`, which
the model side builds). Lazy imports inside functions count: ast sees every import statement.
Outside `kernels/`, kernel helpers come through `batchinfer.kernels.public` (`ChunkTables` etc.),
never through its private modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("batchinfer", "jobs", "cache", "kernels")
# The top-level folders kernels/, cache/ and jobs/ are the packages batchinfer.kernels etc.
INSTALLED_UNDER_BATCHINFER = ("jobs", "cache", "kernels")

# Longest prefix wins: batchinfer.engine is the engine, batchinfer.cli the CLI.
LAYER_OF_PREFIX = {
    "batchinfer": "cli",
    "batchinfer.jobs": "jobs",
    "batchinfer.engine": "engine",
    "batchinfer.cache": "cache",
    "batchinfer.models": "models",
    # The demo checkpoint builder: it writes a model folder from batchinfer.models and imports
    # nothing above it; jobs resolves `model: demo` through it.
    "batchinfer.demo": "models",
    "batchinfer.kernels": "kernels",
}
# Each layer and the layers it may import (besides itself).
MAY_IMPORT = {
    "cli": {"jobs", "engine", "cache", "models", "kernels"},
    "jobs": {"engine", "cache", "models", "kernels"},
    "engine": {"cache", "models", "kernels"},
    "cache": {"engine", "kernels"},
    "models": {"kernels"},
    "kernels": set(),
}


def layer_of(module: str) -> str | None:
    best = None
    for prefix in LAYER_OF_PREFIX:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return None if best is None else LAYER_OF_PREFIX[best]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] in INSTALLED_UNDER_BATCHINFER:
        parts.insert(0, "batchinfer")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module an import statement of `source` names, relative imports resolved (`from X
    import y` names X, and X.y too when y is private: y may be a private submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name.startswith("_"))
    return found


def import_graph(root: Path, top_packages=SCANNED) -> dict[str, set[str]]:
    graph = {}
    for top in top_packages:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).parts
            if parts[0] == "batchinfer" and parts[1] in INSTALLED_UNDER_BATCHINFER:
                continue  # batchinfer/kernels etc. link to the top-level folders, scanned as themselves
            name = module_name(path, root)
            graph[name] = imported_modules(path.read_text(), name, path.name == "__init__.py")
    return graph


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    """'importer -> imported (why)' for each edge against the layers, sorted."""
    bad = []
    for importer, targets in graph.items():
        source = layer_of(importer)
        for target in targets:
            dest = layer_of(target)
            if source is None or dest is None or dest == source and target.split(".")[0] == importer.split(".")[0]:
                continue
            if dest != source and dest not in MAY_IMPORT[source]:
                bad.append(f"{importer} -> {target} ({source} may not import {dest})")
            elif not importer.startswith("batchinfer.kernels") and target.startswith("batchinfer.kernels.") and any(
                    part.startswith("_") for part in target.split(".")):
                bad.append(f"{importer} -> {target} (private kernels module: import it from the package)")
    return sorted(set(bad))


def test_the_tree_follows_the_layers():
    assert forbidden_edges(import_graph(ROOT)) == []


def top_level_layer_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of the bare names `kernels`, `cache`, `jobs`: PyPI has packages of those names
    (Hugging Face's `kernels` sits beside transformers), so ours import as batchinfer.<name>."""
    return sorted(f"{importer} -> {target}" for importer, targets in graph.items() for target in targets
                  if target.split(".")[0] in INSTALLED_UNDER_BATCHINFER)


def test_no_module_imports_a_layer_by_its_top_level_name():
    assert top_level_layer_imports(import_graph(ROOT)) == []


def test_every_scanned_module_has_a_layer():
    assert [m for m in import_graph(ROOT) if layer_of(m) is None] == []


def test_the_checker_reports_an_upward_edge(tmp_path):
    files = {
        "cache/__init__.py": "",
        "cache/pool.py": "def caches():\n    from batchinfer.models.forward_batch import ModelCaches\n",
        "kernels/__init__.py": "",
        "kernels/ops.py": "from ..jobs import spec\nfrom . import _common\n",
        "batchinfer/__init__.py": "",
        "batchinfer/models/__init__.py": "",
        "batchinfer/models/forward_batch.py": ("from batchinfer.kernels._common import ChunkTables\n"
                                               "import batchinfer.kernels.ops\n"),
        "batchinfer/engine/__init__.py": "",
        "batchinfer/engine/engine.py": "from batchinfer.cache import pool\nfrom batchinfer.models import forward_batch\n",
        "jobs/__init__.py": "",
        "jobs/spec/job_file.py": "from . import runner\nfrom batchinfer.models import config\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert forbidden_edges(import_graph(tmp_path)) == [
        "batchinfer.cache.pool -> batchinfer.models.forward_batch (cache may not import models)",
        "batchinfer.kernels.ops -> batchinfer.jobs (kernels may not import jobs)",
        ("batchinfer.models.forward_batch -> batchinfer.kernels._common (private kernels module: "
         "import it from the package)"),
    ]
    (tmp_path / "jobs" / "old.py").write_text("import kernels.ops\nfrom cache import pool\n")
    assert top_level_layer_imports(import_graph(tmp_path)) == ["batchinfer.jobs.old -> cache",
                                                               "batchinfer.jobs.old -> kernels.ops"]



# Inside jobs/: each sub-package may import the ones before it (errors.py under all of them).
JOBS_ORDER = ("errors", "spec", "outdir", "inputs", "global_plan", "tasks", "formats", "run")
# Upward edges the code still has (none: what they needed moved down); a new one fails.
JOBS_UPWARD_KNOWN: set[str] = set()


def jobs_subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["batchinfer", "jobs"] and len(parts) > 2 else None


def upward_jobs_edges(graph: dict[str, set[str]]) -> set[str]:
    edges = set()
    for importer, targets in graph.items():
        source = jobs_subpackage(importer)
        for target in targets:
            dest = jobs_subpackage(target)
            if source in JOBS_ORDER and dest in JOBS_ORDER and JOBS_ORDER.index(dest) > JOBS_ORDER.index(source):
                edges.add(f"{importer} -> {target}")
    return edges


def test_jobs_subpackages_import_downwards():
    graph = import_graph(ROOT)
    assert {jobs_subpackage(m) for m in graph if jobs_subpackage(m)} <= set(JOBS_ORDER), "a jobs/ package without a place"
    assert upward_jobs_edges(graph) - JOBS_UPWARD_KNOWN == set()
    assert JOBS_UPWARD_KNOWN - upward_jobs_edges(graph) == set(), "an edge is gone: take it off the list"


def test_the_jobs_checker_reports_an_upward_edge():
    graph = {"batchinfer.jobs.spec.job_file": {"batchinfer.jobs.run.runner", "batchinfer.jobs.errors"},
             "batchinfer.jobs.run.runner": {"batchinfer.jobs.spec.job_file"}}
    assert upward_jobs_edges(graph) == {"batchinfer.jobs.spec.job_file -> batchinfer.jobs.run.runner"}


PRODUCT_FOLDERS = ("batchinfer", "jobs", "cache", "kernels")


def test_the_product_holds_no_test_hooks():
    # Fault injection enters through the worker recipe a test supplies (tests/worker_faults.py).
    hooks = [f"{path.relative_to(ROOT)}" for folder in PRODUCT_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
             if "BATCHINFER_TEST_" in path.read_text(encoding="utf-8")]
    assert hooks == []
