"""The qwen3.5-35b-a3b preset: the published shapes, and transformers' model of the same config
has exactly the tensors (names and shapes) our layout expects."""
import torch

from batchinfer.models.checkpoint_layout import checkpoint_tensors, detect_layout
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.presets import PRESETS, preset_config
from batchinfer.models.qwen3_hybrid import HybridModel


def test_published_shapes():
    c = preset_config("qwen3.5-35b-a3b")
    assert (c.num_layers, len(c.gdn_layer_ids), len(c.attn_layer_ids)) == (40, 30, 10)
    assert tuple(c.attn_layer_ids)[:2] == (3, 7)  # 3 GDN : 1 attention
    assert all(c.is_moe_layer(i) for i in range(c.num_layers))
    model = HybridModel(c, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert 34.0e9 < total < 36.0e9  # "35B"


def test_transformers_builds_the_same_tensors():
    import transformers as tf

    raw = dict(PRESETS["qwen3.5-35b-a3b"], num_hidden_layers=4)
    hf_config = tf.Qwen3_5MoeTextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = tf.Qwen3_5MoeForCausalLM(hf_config)
    theirs = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    config = model_config_from_dict(raw)
    layout = detect_layout(config, theirs.keys())  # stacked or per-expert, as this transformers holds them
    ours = {spec.name: tuple(spec.shape) for spec in checkpoint_tensors(config, layout)}
    assert ours == theirs
