"""PyPI has top-level packages named `kernels` (Hugging Face's, installed beside transformers),
`cache` and `jobs`: ours import as batchinfer.kernels / .cache / .jobs, so either can sit first
on the path without breaking the other."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_foreign_top_level_packages_of_the_same_names_break_neither(tmp_path):
    for name in ("kernels", "cache", "jobs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("FOREIGN = True\n")
    check = ("import batchinfer.cli, batchinfer.kernels.ops, batchinfer.jobs.runner, batchinfer.cache.state_cache\n"
             "import batchinfer.engine.engine, batchinfer.models.qwen3_hybrid\n"
             "import kernels, cache, jobs\n"
             "assert kernels.FOREIGN and cache.FOREIGN and jobs.FOREIGN\n"
             "assert batchinfer.kernels.ops.__file__.startswith(%r)\n" % str(REPO))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
