"""Eval jobs: each output row's `correct` against the row's answer, and the job's accuracy.

`exact_match`: the generated text equals the answer (or one of a list of answers) after
`normalize_answer` on both — by default the SQuAD evaluation script's normaliser without its
article removal: strip, lowercase, drop punctuation, collapse whitespace (`NormalizeOptions`).
`choice_accuracy` (scoring jobs): the continuation with the highest summed logprob
(`continuation_logprobs`, the first on a tie) is the answer — an integer index into the row's
continuations, or the text of one of them.

`correct` is null where a row cannot be judged: an error row, or a null answer. The accuracy is
the mean of `correct` over the judged samples (each sample of n counts once), with its binomial
standard error sqrt(p (1 - p) / n) (the normal approximation; n = judged samples).
"""
from __future__ import annotations

import math
import re
import string
from typing import Any, Iterable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.spec.task import EvalSpec, NormalizeOptions, TaskSpec

CORRECT_COLUMN = "correct"
CONTINUATION_LOGPROBS_COLUMN = "continuation_logprobs"  # filled by the engine's scoring (task: score)
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.IGNORECASE)


def normalize_answer(text: str, options: NormalizeOptions = NormalizeOptions()) -> str:
    if options.strip:
        text = text.strip()
    if options.lowercase:
        text = text.lower()
    if options.strip_punctuation:
        text = text.translate(_PUNCTUATION)
    if options.remove_articles:
        text = _ARTICLES.sub(" ", text)
    if options.collapse_whitespace:
        text = " ".join(text.split())
    return text


def exact_match(prediction: str, answer: Any, options: NormalizeOptions = NormalizeOptions()) -> Optional[bool]:
    """Whether `prediction` matches `answer` (a string or a list of acceptable strings); None: no answer."""
    answers = [answer] if isinstance(answer, str) else [a for a in (answer or []) if isinstance(a, str)]
    if not answers:
        return None
    predicted = normalize_answer(prediction, options)
    return any(predicted == normalize_answer(a, options) for a in answers)


def choice_correct(logprobs: Optional[list], answer: Any, continuations: Any) -> Optional[bool]:
    """Whether the most likely continuation is the answer (an index, or one continuation's text)."""
    if not logprobs or answer is None or any(v is None or math.isnan(v) for v in logprobs):
        return None
    best = max(range(len(logprobs)), key=lambda i: (logprobs[i], -i))  # the first maximum
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return best == answer
    options = [continuations] if isinstance(continuations, str) else list(continuations or [])
    if isinstance(answer, str) and answer in options:
        return best == options.index(answer)
    return None


def correct_values(task: TaskSpec, table: pa.Table) -> list[Optional[bool]]:
    """`correct` for every row of an output table (its input columns and results)."""
    evaluation = task.eval
    assert evaluation is not None
    answers = table[evaluation.answer_column].to_pylist()
    failed = [reason == "error" for reason in table["finish_reason"].to_pylist()]
    if evaluation.metric == "exact_match":
        judged = [exact_match(text, answer, evaluation.normalize)
                  for text, answer in zip(table["generated_text"].to_pylist(), answers)]
    else:
        assert task.continuations_column is not None
        judged = [choice_correct(scores, answer, options) for scores, answer, options in
                  zip(table[CONTINUATION_LOGPROBS_COLUMN].to_pylist(), answers,
                      table[task.continuations_column].to_pylist())]
    return [None if error else value for value, error in zip(judged, failed)]


def with_correct_column(task: TaskSpec, table: pa.Table) -> pa.Table:
    """The table with its `correct` column appended (unchanged when the job has no eval)."""
    if task.eval is None:
        return table
    return table.append_column(pa.field(CORRECT_COLUMN, pa.bool_()),
                               pa.array(correct_values(task, table), type=pa.bool_()))


def accuracy(values: Iterable[Optional[bool]]) -> dict[str, Any]:
    """Accuracy over the judged values and its binomial standard error sqrt(p (1 - p) / n)."""
    judged = correct = unjudged = 0
    for value in values:
        if value is None:
            unjudged += 1
        else:
            judged += 1
            correct += bool(value)
    p = correct / judged if judged else None
    return {"judged": judged, "correct": correct, "unjudged": unjudged, "accuracy": p,
            "stderr": math.sqrt(p * (1 - p) / judged) if p is not None else None,
            "stderr_formula": "sqrt(p * (1 - p) / n)"}


EXAMPLES_SHOWN = 3  # judged rows the summary shows, so a run's first screen says what was generated


def eval_stats(evaluation: EvalSpec, parts: Iterable, id_column: Optional[str] = None) -> dict[str, Any]:
    """The `_stats.json` section: the accuracy over the `correct` column of every finished part,
    and the first EXAMPLES_SHOWN rows of the first part (id, answer, generated text, correct)."""
    parts = list(parts)

    def values() -> Iterable[Optional[bool]]:
        for path in parts:
            yield from pq.read_table(path, columns=[CORRECT_COLUMN])[CORRECT_COLUMN].to_pylist()

    return {"metric": evaluation.metric, "answer_column": evaluation.answer_column, **accuracy(values()),
            "examples": _examples(parts[0], evaluation.answer_column, id_column) if parts else []}


def _examples(path, answer_column: str, id_column: Optional[str]) -> list[dict[str, Any]]:
    names = set(pq.read_schema(path).names)
    wanted = [c for c in (id_column, answer_column, "generated_text", CORRECT_COLUMN) if c and c in names]
    rows = pq.read_table(path, columns=wanted).slice(0, EXAMPLES_SHOWN).to_pylist()
    return [{"id": row.get(id_column) if id_column else None, "answer": row.get(answer_column),
             "generated_text": row.get("generated_text"), "correct": row.get(CORRECT_COLUMN)} for row in rows]
