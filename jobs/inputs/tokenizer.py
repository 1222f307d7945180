"""A checkpoint's tokenizer without transformers: tokenizer.json, chat template, EOS ids.

Chat templates are rendered the way transformers' `apply_chat_template` renders them
(same sandboxed jinja environment and globals, special tokens passed as variables,
`add_generation_prompt=True`), and the rendered text is encoded without adding special
tokens, as transformers does; so the token ids match `apply_chat_template(tokenize=True)`.
A template is the checkpoint's code: whatever it raises while rendering comes out as a
`jinja2.TemplateError` (`ChatTemplateError` for the rest), which callers make a row's error.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(jinja2.TemplateError):
    """A chat template raised something other than a TemplateError (`{{ 1/0 }}`, a bad operand)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it
    (for training masks); for rendering prompts it is a no-op, but templates must compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile with the environment settings transformers uses for chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(source)


def _token_text(value: Any) -> Optional[str]:
    """Special tokens appear in configs as plain strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _chat_template_source(checkpoint: Path, tokenizer_config: dict) -> Optional[str]:
    # transformers >= 4.43 saves the template as its own file, which takes precedence.
    template_file = checkpoint / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class CheckpointTokenizer:
    """Encoding, decoding and chat rendering for one checkpoint folder."""

    def __init__(self, tokenizer: Tokenizer, chat_template: Optional[str], special_tokens: dict[str, str],
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.chat_template_source = chat_template
        self.special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self._compiled = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> "CheckpointTokenizer":
        checkpoint = Path(checkpoint)
        tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        config = _read_json(checkpoint / "tokenizer_config.json")
        special = {name: text for name in NAMED_SPECIAL_TOKENS if (text := _token_text(config.get(name)))}
        eos_ids: list[int] = []
        # generation_config.json is what generation stops on; the tokenizer's eos and the
        # model config's are fallbacks (older checkpoints set only one of them).
        for source in (_read_json(checkpoint / "generation_config.json"), _read_json(checkpoint / "config.json")):
            value = source.get("eos_token_id")
            eos_ids.extend([value] if isinstance(value, int) else [v for v in (value or []) if isinstance(v, int)])
        if "eos_token" in special and (token_id := tokenizer.token_to_id(special["eos_token"])) is not None:
            eos_ids.append(token_id)
        return cls(tokenizer, _chat_template_source(checkpoint, config), special, tuple(dict.fromkeys(eos_ids)))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._compiled is not None

    def render_chat(self, user_message: str, system: Optional[str] = None,
                    template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """The chat-formatted prompt text for one user turn, ready for the assistant's reply.

        `template_kwargs` become template variables (e.g. enable_thinking), over the special
        tokens, as the keyword arguments of transformers' `apply_chat_template` do.
        """
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": user_message})
        return self.render_messages(messages, template_kwargs)

    @property
    def has_thinking_tags(self) -> bool:
        """Whether the chat template writes reasoning blocks (Qwen3 / Qwen3.5: `<think>...</think>`)."""
        source = self.chat_template_source or ""
        return THINK_OPEN in source and THINK_CLOSE in source

    def render_messages(self, messages: Sequence[dict], template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """The chat-formatted prompt text for a whole conversation (OpenAI-style role/content
        mappings), ready for the assistant's reply; `template_kwargs` as in `render_chat`."""
        if self._compiled is None:
            raise ValueError("the checkpoint has no chat template")
        variables = {"tools": None, "documents": None, **self.special_tokens, **(template_kwargs or {})}
        try:
            return self._compiled.render(messages=list(messages), add_generation_prompt=True, **variables)
        except jinja2.TemplateError:
            raise
        except Exception as exc:  # one template's bug must fail its rows, not the job
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
