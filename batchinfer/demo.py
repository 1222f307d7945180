"""The `demo` checkpoint: the trained look-up model shipped in the package, or a random one.

`model: demo` in a job file resolves here. The shipped model (`batchinfer/demo_checkpoint/`,
docs/DEMO_MODEL.md) is a small Qwen3.5 GDN hybrid trained on `batchinfer.demo_task`'s
document look-up questions. Where it is absent, or with `BATCHINFER_DEMO=random`, the demo is
a random-weight one, deterministic and built offline: a Qwen3.5-text config (3 GDN layers + 1
gated attention layer, hidden 128) with seeded random weights, and a byte-level BPE tokenizer
trained on the embedded text below, with Qwen's special tokens and a ChatML chat template.
Its generations are gibberish; it is small and fast, for tests.

The random checkpoint is built once into `$BATCHINFER_CACHE_DIR/demo-v1` (default
`~/.cache/batchinfer/demo-v1`): built in a temporary sibling folder and renamed, so
concurrent first runs never see a half-written checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

SHIPPED_DEMO_DIR = Path(__file__).with_name("demo_checkpoint")
SHIPPED_DEMO_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json")
DEMO_VERSION = "demo-v1"  # bump when anything below changes: cached copies are keyed by it
DEMO_SEED = 1234
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB = 1024

DEMO_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": TOKENIZER_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": 2,   # <|im_end|>; the ids of SPECIAL_TOKENS are their positions (trained first)
    "pad_token_id": 0,
}

# ChatML as Qwen writes it; the block tags sit on their own lines, so the rendering depends on
# jinja's trim_blocks/lstrip_blocks exactly as a real checkpoint's template does.
CHAT_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- set rest = messages[1:] %}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- set rest = messages %}
{%- endif %}
{% for message in rest %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('unexpected role ' + message['role']) }}
    {% endif %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{% if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

DEMO_CORPUS = """
The river town woke early. Fishermen pulled their boats onto the gravel, and the baker opened
the shutters while the first light touched the bell tower. Children ran along the harbour wall,
counting gulls and shouting the names of ships they hoped to sail one day.
Linear attention keeps a fixed-size state for every sequence. A gated delta rule decays the
state, removes the old value stored under a key, and writes the new one. Hybrid models mix such
layers with a few full attention layers, which keep a cache of keys and values for every token.
A prefix cache stores the work done for a shared beginning of many prompts. When a document is
followed by many questions, the document is read once and every question resumes from its state.
The library catalogue lists books by author, title, subject and year. Readers may borrow up to
six books for three weeks; journals and rare maps must stay in the reading room. Late returns
cost ten cents a day, and lost books are replaced at the current price plus a handling fee.
Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. Chlorophyll absorbs
red and blue light and reflects green, which is why leaves look green. In autumn the chlorophyll
breaks down and yellow and orange pigments become visible before the leaves fall.
The mountain railway climbs twelve hundred metres in forty minutes. Its carriages are pushed by
a small locomotive that grips a toothed rack between the rails. In winter the line closes above
the middle station, and skiers walk the last stretch to the hut on the ridge.
Question: What does the state of a linear attention layer hold? Answer: a matrix per head.
Question: How long may readers borrow books? Answer: three weeks.
Question: Why do leaves look green? Answer: chlorophyll reflects green light.
Question: How high does the railway climb? Answer: twelve hundred metres.
Numbers: one two three four five six seven eight nine ten eleven twelve twenty thirty hundred.
Days: Monday Tuesday Wednesday Thursday Friday Saturday Sunday. Months: January February March
April May June July August September October November December.
The committee met on Thursday to discuss the budget, the new playground, and the repair of the
old bridge. After a long debate, members agreed to ask three firms for quotes and to vote again
in March. The mayor thanked the volunteers who cleaned the park after the spring festival.
Good software is small modules with one job, names that explain themselves, and tests that can
fail. Data flows one way: files in, prompts, tokens, the engine, and results back to files.
"""


def demo_cache_dir() -> Path:
    root = os.environ.get("BATCHINFER_CACHE_DIR") or os.path.join("~", ".cache", "batchinfer")
    return Path(root).expanduser() / DEMO_VERSION


def train_demo_tokenizer():
    """Byte-level BPE trained on DEMO_CORPUS; special tokens get ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Repeating lines in a fixed order gives the trainer enough pair counts to fill the vocab.
    lines = [line for line in DEMO_CORPUS.splitlines() if line.strip()]
    tokenizer.train_from_iterator(lines * 3, trainer=trainer)
    return tokenizer


def write_demo_tokenizer_files(folder: Path) -> None:
    tokenizer = train_demo_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    assert ids == {token: i for i, token in enumerate(SPECIAL_TOKENS)}, ids
    added = {str(i): {"content": token, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False, "special": True} for token, i in ids.items()}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation_config = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": 0,
                         "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


def build_demo_checkpoint(folder: Path) -> None:
    """Write the demo checkpoint's files into an existing, empty `folder`."""
    import torch

    from batchinfer.models.checkpoint_writer import write_random_checkpoint

    write_demo_tokenizer_files(folder)
    write_random_checkpoint(folder, DEMO_CONFIG, DEMO_SEED, torch.float32)


def shipped_demo_checkpoint() -> Optional[Path]:
    """The trained demo's folder inside the package; None where it is not installed."""
    if all((SHIPPED_DEMO_DIR / name).is_file() for name in SHIPPED_DEMO_FILES):
        return SHIPPED_DEMO_DIR
    return None


def demo_checkpoint() -> Path:
    """`model: demo`: the shipped trained checkpoint, else (or with BATCHINFER_DEMO=random) the random one."""
    choice = os.environ.get("BATCHINFER_DEMO", "")
    if choice not in ("", "random"):
        raise ValueError(f"BATCHINFER_DEMO must be 'random' or unset, not {choice!r}")
    shipped = shipped_demo_checkpoint()
    if shipped is not None and choice != "random":
        return shipped
    return random_demo_checkpoint()


def random_demo_checkpoint() -> Path:
    """The random-weight demo checkpoint folder, built on first use."""
    target = demo_cache_dir()
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}-", dir=target.parent))
    try:
        build_demo_checkpoint(staging)
        try:
            os.rename(staging, target)  # atomic; fails if another process won the race
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
