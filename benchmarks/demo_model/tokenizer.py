"""The demo model's tokenizer: a word-level `tokenizers` model over fixed pieces.

Each digit, letter and printable ASCII character is a token; the task's fixed words (the 16
attributes, `The`, `of`, `is`, `What`, `the`, `Question:`, `Answer:`) are single tokens, with or
without a leading space. Names therefore split into letters, values into 4 digits. Any other
character falls back to its UTF-8 bytes (`<0xC3>`...), so every text round-trips.
`<|endoftext|>` (id 0) is EOS and padding.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

from batchinfer.demo_task import ATTRIBUTES

EOS_TOKEN = "<|endoftext|>"
WORDS = ("The", "the", "of", "is", "What") + ATTRIBUTES
COLON_WORDS = ("Question:", "Answer:")
# The demo has no chat format of its own: a chat prompt is the messages' texts, one per line, so
# `chat: true` jobs run too and a user message ending in `Answer:` is the plain task prompt.
CHAT_TEMPLATE = ("{%- for message in messages %}{%- if not loop.first %}{{ '\\n' }}{%- endif %}"
                 "{{- message['content'] }}{%- endfor %}")
CHARACTERS = tuple(string.printable[:95]) + ("\n", "\t")  # digits, letters, punctuation, space


def vocabulary() -> dict[str, int]:
    pieces = [EOS_TOKEN] + list(CHARACTERS) + [f"<0x{b:02X}>" for b in range(256)]
    for word in WORDS + COLON_WORDS:
        pieces += [word, " " + word]
    assert len(set(pieces)) == len(pieces)
    return {piece: i for i, piece in enumerate(pieces)}


def split_pattern() -> str:
    # A word only when no letter follows, so `Theodor` stays letters; anything else is one character.
    words = "|".join(sorted(WORDS, key=len, reverse=True))
    colon_words = "|".join(w.replace(":", r"\:") for w in COLON_WORDS)
    return rf" ?(?:{colon_words})| ?(?:{words})(?![A-Za-z])|[\s\S]"


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    # Every piece the split yields is a whole vocabulary entry or one character outside it (then
    # its bytes): BPE with no merges, matching pieces against the vocabulary first.
    model = models.BPE(vocab=vocabulary(), merges=[], byte_fallback=True, ignore_merges=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(split_pattern()), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])  # pieces carry their spaces
    tokenizer.add_special_tokens([EOS_TOKEN])
    return tokenizer


def write_tokenizer_files(folder: Path, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json (greedy, stops on EOS)."""
    folder = Path(folder)
    tokenizer = build_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    added = {str(tokenizer.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                                             "single_word": False, "special": True} for t in (EOS_TOKEN,)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
              "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "unk_token": None, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
