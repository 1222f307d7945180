"""The job's task settings beyond plain generation: logprobs, scoring, structured output, eval.

    task: score                      # generate (default) | score
    score: {continuations_column: choices}
    sampling: {logprobs: 5}          # or json_schema: {...} | regex: "..." | choice: [a, b]
                                     #    | json_schema_column: schema
                                     # json_schema_strict: false  (objects open as the schema says)
    eval: {answer_column: answer, metric: exact_match, normalize: {lowercase: true}}

Parsed here into one frozen `TaskSpec` (JobSpec.task), so the engine's `SamplingParams` keeps
only what the engine samples with. Shapes and types are checked here; what needs the input or
the tokenizer (columns, compiling the grammar) is checked by `prepare_job`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from batchinfer.jobs.spec import checks as check
from batchinfer.jobs.spec.checks import Checker

# What the engine can do of a task's needs: "logprobs", "score", "grammar". Until the engine wires one,
# a job (or batch line) needing it fails validation with one line; the engine's helper adds it here.
ENGINE_FEATURES: frozenset[str] = frozenset({"logprobs", "score", "grammar"})
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs: the top-k gather and its output column stay small

GRAMMAR_KEYS = ("json_schema", "regex", "choice", "json_schema_column")
STRICT_KEY = "json_schema_strict"  # schemas closed (jobs/tasks/schema_strict.py) unless false
TASK_SAMPLING_KEYS = ("logprobs",) + GRAMMAR_KEYS + (STRICT_KEY,)  # sampling keys SamplingParams does not take
TASK_JOB_KEYS = ("task", "score", "eval")


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint: `kind` json_schema (value: the schema as JSON text), regex
    (the pattern), choice (a tuple of strings) or json_schema_column (value: the column name)."""

    kind: str
    value: Union[str, tuple[str, ...]]
    strict: bool = True  # JSON schemas: objects without additionalProperties are closed (jobs/tasks/schema_strict.py)


@dataclass(frozen=True)
class NormalizeOptions:
    """exact_match's normalisation, applied to prediction and answer alike, in this order.
    The defaults are the SQuAD evaluation script's `normalize_answer` minus article removal."""

    strip: bool = True                # leading / trailing whitespace
    lowercase: bool = True
    strip_punctuation: bool = True    # every character of Python's string.punctuation
    collapse_whitespace: bool = True  # runs of whitespace → one space
    remove_articles: bool = False     # English a / an / the as words (SQuAD does this)


@dataclass(frozen=True)
class EvalSpec:
    answer_column: str
    metric: str = "exact_match"       # exact_match | choice_accuracy
    normalize: NormalizeOptions = NormalizeOptions()


@dataclass(frozen=True)
class TaskSpec:
    task: str = "generate"            # generate | score
    continuations_column: Optional[str] = None  # task score: a list of strings (or one string) per row
    logprobs: Optional[int] = None    # sampling.logprobs: top-k per generated token (0: the chosen token's only)
    grammar: Optional[GrammarSpec] = None
    eval: Optional[EvalSpec] = None

    @property
    def needs_engine_features(self) -> tuple[str, ...]:
        """The key paths of what this task needs from the engine beyond plain generation."""
        needs = []
        if self.logprobs is not None:
            needs.append("sampling.logprobs")
        if self.task == "score":
            needs.append("task")
        if self.grammar is not None:
            needs.append(f"sampling.{self.grammar.kind}")
        return tuple(needs)


NORMALIZE_KEYS = {name: check.boolean for name in NormalizeOptions.__dataclass_fields__}
EVAL_KEYS = {"answer_column": check.text(), "metric": check.choice("exact_match", "choice_accuracy"),
             "normalize": lambda value: value}
SCORE_KEYS = {"continuations_column": check.text()}


def _choices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"must be a non-empty list of non-empty strings, got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError("has a string twice")
    return tuple(value)


def _schema_text(value: Any) -> str:
    """A JSON schema (a mapping, or JSON text of one) as JSON text (hashable, fingerprinted)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON schema (a mapping), got {type(value).__name__}")
    try:
        return json.dumps(value, allow_nan=False)  # key order kept: it is the order properties are generated in
    except (TypeError, ValueError) as exc:  # YAML can hold what JSON cannot (dates, NaN)
        raise ValueError(f"is not expressible as JSON: {exc}") from None


GRAMMAR_CHECKS = {"json_schema": _schema_text, "regex": check.text(), "choice": _choices,
                  "json_schema_column": check.text()}


def split_task_sampling(sampling: Any) -> tuple[Any, dict]:
    """The job's `sampling:` block without the task keys, and those keys (values unchecked)."""
    if not isinstance(sampling, dict):
        return sampling, {}
    rest = {k: v for k, v in sampling.items() if k not in TASK_SAMPLING_KEYS}
    return rest, {k: v for k, v in sampling.items() if k in TASK_SAMPLING_KEYS}


def parse_task(checker: Checker, raw: dict, task_sampling: dict, where: str) -> TaskSpec:
    """`raw`: the job mapping (task, score, eval); `task_sampling`: from `split_task_sampling`."""
    def fail(key: str, what: str) -> Exception:
        return checker.fail(f"{where}.{key}", what)

    try:
        task = check.choice("generate", "score")(raw.get("task", "generate"))
    except ValueError as exc:
        raise fail("task", str(exc)) from None
    continuations = None
    if "score" in raw:
        if task != "score":
            raise fail("score", "needs task: score")
        continuations = checker.section(raw["score"], f"{where}.score", SCORE_KEYS).get("continuations_column")
    if task == "score" and continuations is None:
        raise fail("score.continuations_column", "missing (required with task: score)")
    logprobs = None
    if "logprobs" in task_sampling:
        try:
            logprobs = check.integer(0, high=MAX_LOGPROBS)(task_sampling["logprobs"])
        except ValueError as exc:
            raise fail("sampling.logprobs", str(exc)) from None
    given = [key for key in GRAMMAR_KEYS if key in task_sampling]
    if len(given) > 1:
        raise fail(f"sampling.{given[1]}", f"cannot be given with sampling.{given[0]} (one constraint per job)")
    grammar = None
    if given:
        kind = given[0]
        try:
            grammar = GrammarSpec(kind, GRAMMAR_CHECKS[kind](task_sampling[kind]))
        except ValueError as exc:
            raise fail(f"sampling.{kind}", str(exc)) from None
        if task == "score":
            raise fail(f"sampling.{kind}", "cannot constrain a score task (it generates nothing)")
    if STRICT_KEY in task_sampling:
        if grammar is None or grammar.kind not in ("json_schema", "json_schema_column"):
            raise fail(f"sampling.{STRICT_KEY}", "applies to sampling.json_schema or json_schema_column only")
        try:
            grammar = GrammarSpec(grammar.kind, grammar.value, check.boolean(task_sampling[STRICT_KEY]))
        except ValueError as exc:
            raise fail(f"sampling.{STRICT_KEY}", str(exc)) from None
    evaluation = None
    if "eval" in raw:
        values = checker.section(raw["eval"], f"{where}.eval", EVAL_KEYS)
        if "answer_column" not in values:
            raise fail("eval.answer_column", "missing (required)")
        normalize = checker.section(values.pop("normalize", {}), f"{where}.eval.normalize", NORMALIZE_KEYS)
        evaluation = EvalSpec(normalize=NormalizeOptions(**normalize), **values)
        if evaluation.metric == "choice_accuracy" and task != "score":
            raise fail("eval.metric", "choice_accuracy scores continuations: it needs task: score")
        if evaluation.metric == "exact_match" and task == "score":
            raise fail("eval.metric", "a score task generates no text to match: use choice_accuracy")
        if normalize and evaluation.metric != "exact_match":
            raise fail("eval.normalize", "applies to metric exact_match only")
    return TaskSpec(task=task, continuations_column=continuations, logprobs=logprobs, grammar=grammar,
                    eval=evaluation)
