"""The loader's streamed path (large sequential reads into staging buffers, as onto CUDA) gives
exactly the memory-mapped path's weights, for every layout, and keeps its errors."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import batchinfer.models.loader as loader
from batchinfer.models import CheckpointError
from batchinfer.models.config import load_model_config
from batchinfer.models.qwen3_hybrid import HybridModel
from tests.model_utils import make_tiny_checkpoint


def _load(path, streamed: bool, dtype=torch.float32) -> HybridModel:
    model = HybridModel(load_model_config(path), dtype, "cpu")
    loader.load_weights(model, path, streamed=streamed)
    return model


@pytest.mark.parametrize("kind,sharded", [("qwen3_5", True), ("qwen3_next", False), ("qwen3_5_moe", False),
                                          ("qwen3_5_vlm", False)])
def test_streamed_equals_mapped(tmp_path, monkeypatch, kind, sharded):
    path = make_tiny_checkpoint(tmp_path, kind, sharded=sharded, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        mapped = _load(path, streamed=False, dtype=dtype)
        with monkeypatch.context() as patch:
            patch.setattr(loader, "STAGING_BYTES", 4096)  # many reads, and tensors larger than one
            streamed = _load(path, streamed=True, dtype=dtype)
        a, b = mapped.state_dict(), streamed.state_dict()
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_streamed_read_of_a_truncated_file_names_it(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3_5", seed=1)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        _load(path, streamed=True)


def test_streamed_misshapen_tensor_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3_5", seed=1)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name}.*has shape"):
        _load(path, streamed=True)
