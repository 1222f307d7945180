"""Each row's output constraint for the engine: the job's grammar (compiled once), or a schema
from a column (`sampling.json_schema_column`, an OpenAI batch line's `response_format`), compiled
once per distinct schema text. A schema that cannot be compiled makes its row an error row.
A column's schemas are strict as the job's `sampling.json_schema_strict` says; a batch line's
schema was made strict (or not, by its `strict` flag) when the line was read."""
from __future__ import annotations

from typing import Any, Optional

from batchinfer.jobs.spec.job_file import JobSpec, openai_batch_input
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

BATCH_SCHEMA_COLUMN = "response_schema"  # openai_batch.BATCH_SCHEMA's response_format json_schema


class RowGrammars:
    def __init__(self, spec: JobSpec, tokenizer: CheckpointTokenizer, vocab_size: int) -> None:
        grammar = spec.task.grammar
        self.column: Optional[str] = None
        self._job = None
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._by_text: dict[str, tuple[Any, Optional[str]]] = {}
        self._strict = grammar.strict if grammar is not None else True
        if grammar is not None and grammar.kind == "json_schema_column":
            self.column = str(grammar.value)
        elif grammar is not None:
            from batchinfer.jobs.tasks.structured import compile_grammar

            self._job = compile_grammar(grammar, tokenizer, vocab_size)  # validated by prepare_job
        if openai_batch_input(spec):
            self.column = BATCH_SCHEMA_COLUMN  # a line's response_format overrides the job's constraint
            self._strict = False  # applied per line by openai_batch, where its `strict` flag is

    def for_row(self, cell: Any) -> tuple[Any, Optional[str]]:
        """(the row's compiled grammar or None, why the row's schema cannot be compiled or None)."""
        if cell is None:
            return self._job, None
        if cell not in self._by_text:
            from batchinfer.jobs.tasks.structured import GrammarError, compile_source, grammar_source, grammar_tokenizer

            try:
                compiled = compile_source(grammar_source("json_schema", cell, self._strict),
                                          grammar_tokenizer(self._tokenizer, self._vocab_size))
                self._by_text[cell] = (compiled, None)
            except GrammarError as exc:
                self._by_text[cell] = (None, f"the row's JSON schema cannot be compiled: {exc}")
        return self._by_text[cell]
