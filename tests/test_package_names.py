"""PyPI has top-level packages named `kernels` (Hugging Face's, installed beside transformers),
`cache` and `jobs`: ours import as batchinfer.kernels / .cache / .jobs, so either can sit first
on the path without breaking the other, the checkout root included (`python -m pytest` and
`python -m benchmarks...` put it first)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "cache", "jobs")


def test_foreign_top_level_packages_of_the_same_names_break_neither(tmp_path):
    for name in ("kernels", "cache", "jobs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("FOREIGN = True\n")
    check = ("import batchinfer.cli, batchinfer.kernels.ops, batchinfer.jobs.run.runner, batchinfer.cache.state_cache\n"
             "import batchinfer.engine.engine, batchinfer.models.qwen3_hybrid\n"
             "import kernels, cache, jobs\n"
             "assert kernels.FOREIGN and cache.FOREIGN and jobs.FOREIGN\n"
             "assert batchinfer.kernels.ops.__file__.startswith(%r)\n" % str(REPO))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_layer_folders_are_linked_into_the_package_and_have_no_init():
    for name in LAYERS:
        link = REPO / "batchinfer" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
        assert not (REPO / name / "__init__.py").exists(), f"{name}/__init__.py would shadow PyPI's {name!r}"


def _from_the_checkout_root(code: str) -> subprocess.CompletedProcess:
    """`python -c` puts the current folder first on sys.path, as `python -m pytest` does."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_checkout_root_shadows_no_installed_package():
    done = _from_the_checkout_root(
        "import importlib.util as u\n"
        "for name in ('kernels', 'cache', 'jobs'):\n"
        "    spec = u.find_spec(name)\n"
        "    print(name, spec.origin if spec and spec.origin not in (None, 'namespace') else '-')\n"
        "import batchinfer.kernels.public, batchinfer.cache.state_cache, batchinfer.jobs.spec.job_file\n"
        "print('package', batchinfer.kernels.public.__file__)")
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for name in LAYERS:
        assert not lines[name].startswith(str(REPO)), f"{name} resolves to the checkout: {lines[name]}"
    assert lines["package"].startswith(str(REPO / "batchinfer" / "kernels"))


def test_transformers_imports_from_the_checkout_root():
    pytest.importorskip("transformers")
    done = _from_the_checkout_root("import transformers.activations, transformers.models.qwen3_next")
    assert done.returncode == 0, done.stderr[-2000:]
