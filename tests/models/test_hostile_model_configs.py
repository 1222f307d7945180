"""Malformed config.json: checked once, for types, ranges and against the weights' shapes (read
from the safetensors headers, before anything is allocated). Each is one line naming config.json
and the key, exit 2, nothing written."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from batchinfer.demo import build_demo_checkpoint
from batchinfer.models.config import ModelConfigError
from batchinfer.models.loader import empty_model
from tests.jobs_fixtures import job_entry, rag_table, write_job_file, write_parquet
from tests.cli.test_cli_errors import run_cli


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "demo"
    folder.mkdir()
    build_demo_checkpoint(folder)  # the demo's config (4 layers) with random weights
    return folder


def edited(checkpoint: Path, folder: Path, edit: Callable[[dict], Any]) -> Path:
    copy = folder / "ckpt"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    replaced = edit(config)
    (copy / "config.json").write_text(json.dumps(replaced if isinstance(replaced, list) else config))
    return copy


def plan_error(folder: Path, checkpoint: Path) -> str:
    write_parquet(rag_table(3), folder / "data" / "rag.parquet")
    write_job_file(folder, [job_entry(model=str(checkpoint))])
    return run_cli(folder, "plan", "jobs.yaml")


def drop(config: dict, *keys: str) -> None:
    for key in keys:
        config.pop(key, None)


EDITS = {  # name → (edit of config.json, key named, what the line says)
    "kv_heads_0": (lambda c: c.update(num_key_value_heads=0), "num_key_value_heads", "must be in [1, "),
    "heads_0_no_head_dim": (lambda c: (c.update(num_attention_heads=0), drop(c, "head_dim")),
                            "num_attention_heads", "must be in [1, "),
    "layers_text": (lambda c: c.update(num_hidden_layers="abc"), "num_hidden_layers", 'must be an integer, got "abc"'),
    "layers_null": (lambda c: c.update(num_hidden_layers=None), "num_hidden_layers", "must be an integer, got null"),
    "layers_float": (lambda c: c.update(num_hidden_layers=8.7), "num_hidden_layers", "must be an integer, got 8.7"),
    "layers_bool": (lambda c: c.update(num_hidden_layers=True), "num_hidden_layers", "must be an integer, got true"),
    "a_json_list": (lambda c: [c], "(top level)", "must hold a JSON object, got a JSON array"),
    "interval_0": (lambda c: (c.update(full_attention_interval=0), drop(c, "layer_types")),
                   "full_attention_interval", "must be in [1, "),
    "max_positions_0": (lambda c: c.update(max_position_embeddings=0), "max_position_embeddings", "must be in [2, "),
    "eps_text": (lambda c: c.update(rms_norm_eps="1e-6"), "rms_norm_eps", "must be a finite number"),
    "tie_text": (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings", "must be true or false"),
    "eos_text": (lambda c: c.update(eos_token_id="2"), "eos_token_id", "must be a token id"),
    "rope_text": (lambda c: c.update(rope_parameters="default"), "rope_parameters", "must be an object"),
    "layers_million": (lambda c: (c.update(num_hidden_layers=1_000_000), drop(c, "layer_types")),
                       "num_hidden_layers", "must be in [1, 65536], got 1000000"),
    "layers_fewer_than_weights": (lambda c: (c.update(num_hidden_layers=3), drop(c, "layer_types")),
                                  "num_hidden_layers", "is 3, but the checkpoint's tensors hold 4 layers"),
    "layers_more_than_weights": (lambda c: (c.update(num_hidden_layers=4000), drop(c, "layer_types")),
                                 "num_hidden_layers", "is 4000, but the checkpoint's tensors hold 4 layers"),
    "layer_types_short": (lambda c: c.update(layer_types=["linear_attention"]), "layer_types", "has 1 entries"),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_a_malformed_config_is_one_line_naming_config_json_and_the_key(tmp_path, checkpoint, name):
    edit, key, what = EDITS[name]
    start = time.monotonic()
    line = plan_error(tmp_path, edited(checkpoint, tmp_path, edit))
    assert line.startswith(f"error: ckpt/config.json: {key}: "), line
    assert what in line, line
    assert time.monotonic() - start < 30  # nothing the size of the config was built


def test_sizes_that_do_not_match_the_weights_name_the_tensor(tmp_path, checkpoint):
    line = plan_error(tmp_path, edited(checkpoint, tmp_path, lambda c: c.update(vocab_size=c["vocab_size"] * 2)))
    assert line.startswith("error: jobs.yaml: jobs.rag.model: tensor 'model.embed_tokens.weight' in "
                           "model.safetensors has shape ["), line
    assert "(from config.json)" in line


def test_the_loader_checks_the_layer_count_before_allocating(tmp_path, checkpoint):
    broken = edited(checkpoint, tmp_path, lambda c: (c.update(num_hidden_layers=60_000), drop(c, "layer_types")))
    start = time.monotonic()
    with pytest.raises(ModelConfigError, match="num_hidden_layers: is 60000, but the checkpoint's tensors hold 4"):
        empty_model(broken)
    assert time.monotonic() - start < 10


def test_the_unedited_checkpoint_plans(tmp_path, checkpoint):
    write_parquet(rag_table(3), tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint))])
    from click.testing import CliRunner

    from batchinfer.cli import main
    result = CliRunner().invoke(main, ["plan", str(tmp_path / "jobs.yaml")])
    assert result.exit_code == 0, result.output
