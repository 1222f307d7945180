"""Structured output, the grammar side: a job's constraint compiled for its tokenizer, and one
matcher per sequence that says which tokens may come next.

    grammar = compile_grammar(spec.task.grammar, tokenizer, vocab_size)   # GrammarError: one line
    matcher = grammar.matcher()                 # per sequence (sample)
    bits = new_bitmask(1, vocab_size)            # int32 [B, ceil(V / 32)], bit t of row b: token t allowed
    matcher.fill_mask(bits[0]); token = sample(logits masked by bits[0]); matcher.accept(token)

The engine is llguidance (Microsoft's Rust grammar engine, also a vLLM / SGLang backend): an
abi3 wheel with no Python dependencies that builds its token trie from a `tokenizers` JSON
(no transformers at run time), computes masks on the CPU in tens of microseconds a token, and
accepts JSON schema, regex and Lark. xgrammar needs transformers-era dependencies to take a
tokenizer. The mask is a plain int32 bitmask, so the engine can upload it and mask the logits
on the device; `fill_masks` fills a whole batch on llguidance's own threads (the GIL released),
which can run while the forward pass does.

JSON is generated compact (no free whitespace between tokens): a flexible-whitespace grammar lets
a weak model emit whitespace until the token budget ends. JSON schemas are strict unless the job
says otherwise: an object without `additionalProperties` admits no other key (jobs/tasks/schema_strict.py). `choice` is the alternation of the
literal strings. The EOS token is allowed exactly when the text so far is complete.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from batchinfer.jobs.tasks.schema_strict import strict_schema_text
from batchinfer.jobs.spec.task import GrammarSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The constraint cannot be compiled (its message is one line)."""


def _one_line(message: str) -> str:
    return " ".join(message.split())


@dataclass(frozen=True)
class GrammarSource:
    """What llguidance compiles: a grammar text (llguidance's JSON form)."""

    text: str


def grammar_source(kind: str, value: object, strict: bool = True) -> GrammarSource:
    """The llguidance grammar for a constraint: json_schema (JSON text; `strict`: its open objects
    closed), regex (a pattern) or choice (strings); raises GrammarError for a value llguidance
    cannot even read."""
    if kind == "json_schema":
        text = strict_schema_text(str(value)) if strict else str(value)
        try:
            return GrammarSource(llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS))
        except ValueError as exc:
            raise GrammarError(_one_line(str(exc))) from None
    if kind == "regex":
        return GrammarSource(llguidance.LLMatcher.grammar_from_regex(str(value)))
    if kind == "choice":
        # Lark string literals take JSON's escapes, so json.dumps quotes any text exactly.
        alternatives = " | ".join(json.dumps(choice) for choice in value)  # type: ignore[union-attr]
        return GrammarSource(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    raise GrammarError(f"unknown constraint kind {kind!r}")


_TOKENIZERS: dict[tuple[int, int], llguidance.LLTokenizer] = {}


def grammar_tokenizer(tokenizer: CheckpointTokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the checkpoint's tokenizer (built once per tokenizer: ~0.1-1 s for a
    150k vocabulary). `vocab_size` is the model's (its padded ids are never allowed)."""
    key = (id(tokenizer), vocab_size)
    cached = _TOKENIZERS.get(key)
    if cached is None:
        eos = list(tokenizer.eos_token_ids) or None
        cached = _TOKENIZERS[key] = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size,
                                                           eos_token=eos)
    return cached


class SequenceMatcher:
    """One sequence's position in the grammar. `fill_mask` writes the allowed next tokens into an
    int32 bitmask row; `accept` moves past the sampled token (False: it was not allowed, the
    matcher is then in error and stays there)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask_row: np.ndarray) -> None:  # int32 [ceil(V / 32)], C-contiguous
        llg_numpy.fill_next_token_bitmask(self._matcher, bitmask_row.reshape(1, -1))

    def accept(self, token: int) -> bool:
        return bool(self._matcher.consume_token(int(token)))

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (after the EOS token, or at the end of a fixed text)."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The text so far is complete (EOS may come now)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> Optional[str]:
        return self._matcher.get_error() if self._matcher.is_error() else None

    @property
    def handle(self) -> llguidance.LLMatcher:
        """The llguidance matcher, for `fill_masks` over a batch."""
        return self._matcher


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar for one tokenizer; `matcher()` starts a sequence at its beginning."""

    source: GrammarSource
    tokenizer: llguidance.LLTokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @staticmethod
    def fill_masks(matchers: Sequence[SequenceMatcher], bitmask: np.ndarray) -> None:
        """`fill_masks` (the engine's batch call; matchers of any grammar)."""
        fill_masks(matchers, bitmask)

    def matcher(self) -> SequenceMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, self.source.text, log_level=0)
        if matcher.is_error():  # validated in compile_grammar: only a resource limit gets here
            raise GrammarError(_one_line(matcher.get_error()))
        return SequenceMatcher(matcher)


def compile_source(source: GrammarSource, tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
    error = llguidance.LLMatcher.validate_grammar(source.text, tokenizer)
    if error:
        raise GrammarError(_one_line(error))
    return CompiledGrammar(source, tokenizer)


def compile_grammar(spec: GrammarSpec, tokenizer: CheckpointTokenizer, vocab_size: int) -> CompiledGrammar:
    """A job's constraint compiled for its tokenizer; GrammarError says why it cannot be."""
    return compile_source(grammar_source(spec.kind, spec.value, spec.strict), grammar_tokenizer(tokenizer, vocab_size))


def new_bitmask(batch: int, vocab_size: int) -> np.ndarray:
    """An all-allowed int32 bitmask [batch, ceil(vocab_size / 32)]."""
    return llg_numpy.allocate_token_bitmask(batch, vocab_size)


_EXECUTOR: Optional[llguidance.LLExecutor] = None


def mask_threads() -> int:
    """Threads of the mask pool: `BATCHINFER_GRAMMAR_THREADS`, else every CPU this process may run
    on, up to 32. llguidance's own default is 80% of them; the masks of a step run while the host
    waits on the forward pass, and the last 20% took a schema with maxLength from +5.3% to +2.0%
    of the decode step (docs/BENCHMARKS.md, "Structured output and logprobs overhead")."""
    value = os.environ.get("BATCHINFER_GRAMMAR_THREADS", "").strip()
    if not value:
        return max(1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    if not value.isdigit() or int(value) < 1:
        raise GrammarError(f"BATCHINFER_GRAMMAR_THREADS must be a positive integer, got {value!r}")
    return int(value)


def set_mask_threads(threads: int) -> None:
    """Rebuild the mask pool with `threads`; benchmarks compare sizes."""
    global _EXECUTOR
    _EXECUTOR = llguidance.LLExecutor(threads)


def fill_masks(matchers: Sequence[SequenceMatcher], bitmask: np.ndarray) -> None:
    """Row i of `bitmask` [B, W] ← matchers[i]'s allowed tokens, on llguidance's thread pool."""
    if _EXECUTOR is None:
        set_mask_threads(mask_threads())
    llg_numpy.fill_next_token_bitmask_par(_EXECUTOR, [(m.handle, i) for i, m in enumerate(matchers)], bitmask)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (int64 [k]): bit t % 32 of word t // 32."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask_row).view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)
