"""The engine's up-front parallel compile on CUDA: graph capture then compiles nothing, a second
engine on the same disk cache starts no worker, and the tokens equal those of lazy compiling."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import requires_cuda

pytestmark = [requires_cuda, pytest.mark.gpu]
REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    import triton
    from batchinfer.engine import Engine, EngineConfig
    from batchinfer.engine.types import SamplingParams
    from tests.engine_utils import requests_for, shared_prefix_prompts

    lazy = {"init": 0, "generate": 0}
    phase = ["init"]

    def count(**kwargs):
        if not kwargs.get("is_manual_warmup"):  # preloads are warm-ups; a launch's own compile is not
            lazy[phase[0]] += 1

    triton.knobs.runtime.jit_post_compile_hook = count
    config = EngineConfig(device="cuda", dtype="float32", max_running=16, memory_budget_bytes=64 << 20)
    model = sys.argv[1]  # a preset (random weights) or a checkpoint (loaded while the kernels compile)
    engine = Engine.from_pretrained(model, config, seed=1)
    report = engine.precompile_report
    phase[0] = "generate"
    requests = requests_for(shared_prefix_prompts(seed=2), SamplingParams(max_tokens=24, ignore_eos=True))
    tokens = {f"{o.request_id}/{o.sample_index}": list(o.token_ids) for o in engine.generate(requests)}
    again = Engine.from_pretrained(model, config, seed=1).precompile_report  # in-memory: nothing traced
    print(json.dumps({"report": None if report is None else report.__dict__, "lazy": lazy, "tokens": tokens,
                      "again": None if again is None else again.__dict__}))
""")


def _run(tmp_path: Path, workers: str, cache: str, model: str = "tiny") -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / cache),
           "BATCHINFER_PRECOMPILE": workers,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SCRIPT, model], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_precompile_covers_graph_capture_and_keeps_tokens(tmp_path):
    fresh = _run(tmp_path, "4", "cache")
    report = fresh["report"]
    assert report["kernels"] > 0 and report["missing"] == report["kernels"] == report["compiled"]
    assert fresh["lazy"]["init"] == 0, fresh["lazy"]  # every decode-graph bucket's kernels were traced
    print("lazy compiles during generation:", fresh["lazy"]["generate"])
    assert fresh["again"]["kernels"] == 0
    warm = _run(tmp_path, "4", "cache")  # a new process on the filled disk cache
    assert warm["report"]["missing"] == 0 and warm["report"]["workers"] == 0
    lazy = _run(tmp_path, "0", "lazy-cache")
    assert lazy["report"] is None
    assert fresh["tokens"] == lazy["tokens"] == warm["tokens"]


def test_checkpoint_loaded_during_the_compile_keeps_tokens(tmp_path):
    import torch

    from batchinfer.models.checkpoint_writer import write_random_checkpoint
    from batchinfer.models.presets import PRESETS

    checkpoint = str(write_random_checkpoint(tmp_path / "ckpt", PRESETS["tiny"], seed=1, dtype=torch.float32))
    overlapped = _run(tmp_path, "4", "cache", checkpoint)
    assert overlapped["report"]["compiled"] == overlapped["report"]["kernels"] > 0
    assert overlapped["lazy"]["init"] == 0, overlapped["lazy"]
    lazy = _run(tmp_path, "0", "lazy-cache", checkpoint)
    assert overlapped["tokens"] == lazy["tokens"]


def test_warmup_command_fills_the_cache_for_the_run(tmp_path):
    import yaml

    job = {"name": "rag", "model": "demo", "input": "unused.parquet", "prompt": {"template": "{q}"},
           "engine": {"device": "cuda", "max_running": 16}}
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump({"jobs": [job]}))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "batchinfer", "warmup", str(tmp_path / "jobs.yaml")], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Triton kernels" in done.stdout
    check = textwrap.dedent("""
        import json, sys
        from batchinfer.demo import demo_checkpoint
        from batchinfer.engine import Engine, EngineConfig
        from batchinfer.jobs.spec.job_file import engine_config_kwargs, load_job_file
        spec = load_job_file(sys.argv[1]).jobs[0]  # the engine settings the run would use
        engine = Engine.from_pretrained(str(demo_checkpoint()), EngineConfig(**engine_config_kwargs(spec.engine)))
        print(json.dumps(engine.precompile_report.__dict__))
    """)
    done = subprocess.run([sys.executable, "-c", check, str(tmp_path / "jobs.yaml")], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["kernels"] > 0 and report["missing"] == 0  # the run found everything in the cache
