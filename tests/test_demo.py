"""The demo checkpoint: deterministic, concurrency-safe, loadable, and its chat prompts equal transformers'."""
from __future__ import annotations

import hashlib
import threading
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


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """Two processes' worth of racing first builds into one cache folder."""
    cache = tmp_path_factory.mktemp("cache")
    results: list[Path] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHINFER_CACHE_DIR", str(cache))
        threads = [threading.Thread(target=lambda: results.append(demo_checkpoint())) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == [cache / DEMO_VERSION] * 2
    assert sorted(p.name for p in cache.iterdir()) == [DEMO_VERSION]  # no staging folder left behind
    return results[0]


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
