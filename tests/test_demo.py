"""The demo checkpoint: deterministic, concurrency-safe, loadable, and its chat prompts equal transformers'."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from batchinfer.demo import DEMO_VERSION, demo_checkpoint
from batchinfer.models.config import load_model_config
from jobs.prompts import build_prompts
from jobs.spec import PromptSpec
from jobs.tokenizer import CheckpointTokenizer


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# Each child says it is ready, waits for the go file, then builds: both find no checkpoint and
# race to rename theirs into place.
RACER = """
import os, sys, time
from batchinfer.demo import demo_cache_dir, demo_checkpoint
ready, go = sys.argv[1:]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.005)
print(demo_cache_dir().is_dir(), demo_checkpoint())
"""


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """Two processes' racing first builds into one cache folder."""
    cache = tmp_path_factory.mktemp("cache")
    signals = tmp_path_factory.mktemp("signals")
    env = {**os.environ, "BATCHINFER_CACHE_DIR": str(cache)}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(signals / f"ready{i}"), str(signals / "go")],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((signals / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.01)
    (signals / "go").touch()
    results = [racer.communicate(timeout=300) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err for _, err in results]
    assert [out.split() for out, _ in results] == [["False", str(cache / DEMO_VERSION)]] * 2  # both built
    assert sorted(p.name for p in cache.iterdir()) == [DEMO_VERSION]  # no staging folder left behind
    return cache / DEMO_VERSION


def test_demo_is_deterministic_and_complete(demo_dir, tmp_path, monkeypatch):
    assert sorted(p.name for p in demo_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path))
    assert file_hashes(demo_checkpoint()) == file_hashes(demo_dir)
    config = load_model_config(demo_dir)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    tokenizer = CheckpointTokenizer.from_checkpoint(demo_dir)
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.eos_token_ids == (2, 0)
    text = "The river town woke early, 12 résumés 🙂"
    assert tokenizer.decode(tokenizer.encode_batch([text])[0]) == text  # byte-level: lossless


@pytest.mark.parametrize("system", [None, "You answer in one word."])
def test_chat_prompts_equal_transformers_apply_chat_template(demo_dir, system):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(demo_dir))
    questions = ["What does the state hold?", "  Why do leaves look green?\n", "x" * 7]
    batch = build_prompts(pa.table({"q": questions}), PromptSpec(column="q"),
                          CheckpointTokenizer.from_checkpoint(demo_dir), chat=True, system=system, vocab_size=1024)
    for question, ids in zip(questions, batch.token_ids):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
        assert ids == list(expected)
