"""Eval settings: per-row `correct`, the job's accuracy with its standard error, and the spec's checks."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.tasks.eval_metrics import accuracy, choice_correct, correct_values, exact_match, normalize_answer
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file, parse_job_file
from batchinfer.jobs.spec.task import EvalSpec, NormalizeOptions, TaskSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, write_job_file, write_parquet

ROWS = 13


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def test_normalisation_is_squad_like_and_each_step_can_be_turned_off():
    assert normalize_answer("  The  Eiffel\tTower!  ") == "the eiffel tower"
    assert normalize_answer("The Tower", NormalizeOptions(remove_articles=True)) == "tower"
    assert normalize_answer(" A.B ", NormalizeOptions(strip_punctuation=False, lowercase=False)) == "A.B"
    assert exact_match("paris.", "Paris") and exact_match("Lyon", ["Paris", "lyon"])
    assert exact_match("Paris", "Paris", NormalizeOptions(lowercase=False))
    assert exact_match("paris", "Paris", NormalizeOptions(lowercase=False)) is False
    assert exact_match("x", None) is None and exact_match("x", []) is None


def test_choice_accuracy_takes_the_first_most_likely_continuation():
    assert choice_correct([-3.0, -1.0, -2.0], 1, ["a", "b", "c"]) is True
    assert choice_correct([-3.0, -1.0, -1.0], 2, ["a", "b", "c"]) is False  # a tie goes to the first
    assert choice_correct([-3.0, -1.0], "b", ["a", "b"]) is True
    assert choice_correct([-3.0, -1.0], "z", ["a", "b"]) is None
    assert choice_correct(None, 0, ["a"]) is None


def test_choice_accuracy_over_a_hand_made_continuation_logprobs_column():
    task = TaskSpec(task="score", continuations_column="choices",
                    eval=EvalSpec(answer_column="answer", metric="choice_accuracy"))
    table = pa.table({"choices": [["a", "b"], ["a", "b"], ["x", "y"], ["a", "b"]],
                      "answer": [0, 1, 1, 0],
                      "continuation_logprobs": [[-0.5, -2.0], [-0.5, -2.0], [-9.0, -1.0], [-1.0, -0.5]],
                      "finish_reason": ["stop", "stop", "stop", "error"]})
    assert correct_values(task, table) == [True, False, True, None]


def test_accuracy_and_its_binomial_standard_error():
    summary = accuracy([True, False, True, True, None])
    assert (summary["judged"], summary["correct"], summary["unjudged"]) == (4, 3, 1)
    assert summary["accuracy"] == 0.75 and summary["stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert accuracy([None])["accuracy"] is None


@dataclass
class AnsweringEngine(FakeEngine):
    """Answers row r with `answers[r]` (encoded), whatever the prompt."""

    answers: tuple = ()
    tokenizer: CheckpointTokenizer = None

    def generate(self, requests):
        for output in super().generate(requests):
            tokens = tuple(self.tokenizer.encode_batch([self.answers[output.request_id]], add_special_tokens=False)[0])
            yield replace(output, token_ids=tokens, completion_tokens=len(tokens), finish_reason="stop")


@pytest.mark.parametrize("plan", ["global", "window"])
def test_an_eval_job_writes_correct_per_row_and_accuracy_in_the_stats(tmp_path, checkpoint, plan):
    answers = ["Paris" if r % 3 else None for r in range(ROWS)]  # 4 rows without an answer
    said = [" paris!" if r % 2 else "Lyon" for r in range(ROWS)]
    table = pa.table({"question": [f"Capital #{r}?" for r in range(ROWS)], "answer": answers})
    write_parquet(table, tmp_path / "data" / "rag.parquet", row_group_size=4)
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), prompt={"template": "{question}"},
                                                   eval={"answer_column": "answer"})])
    job = prepare_job(load_job_file(job_file).jobs[0])
    engine = AnsweringEngine(answers=tuple(said), tokenizer=job.tokenizer)
    stats = run_job(job, Console(quiet=True), engine_factory=lambda _j, _w: engine, window_rows=5, plan=plan)
    out = pq.read_table(tmp_path / "out" / "rag").sort_by("row_index")
    expected = [None if answers[r] is None else said[r] == " paris!" for r in range(ROWS)]
    assert out["correct"].to_pylist() == expected
    judged = [e for e in expected if e is not None]
    p = sum(judged) / len(judged)
    assert stats["eval"]["accuracy"] == pytest.approx(p) and stats["eval"]["judged"] == len(judged)
    assert stats["eval"]["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / len(judged)))
    assert json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())["eval"] == stats["eval"]
    examples = stats["eval"]["examples"]  # the summary's sample answers: rows of the output, as written
    assert 0 < len(examples) <= 3
    by_index = {row["row_index"]: row for row in out.to_pylist()}
    for example in examples:
        row = next(r for r in by_index.values() if r["generated_text"] == example["generated_text"]
                   and r["answer"] == example["answer"] and r["correct"] == example["correct"])
        assert row is not None


def test_the_summary_shows_the_examples_it_was_given():
    from io import StringIO

    from batchinfer.jobs.outdir.stats import render_summary
    console = Console(file=StringIO(), width=200)
    stats = {"job": "j", "status": "done", "rows": 1, "samples": 1, "samples_written": 1, "samples_resumed": 0,
             "errors": 0, "prompt_tokens": 3, "cached_tokens": 0, "planned_cached_tokens": 0,
             "cache_hit_rate": 0.0, "planned_cache_hit_rate": 0.0, "discarded_kv_tokens": 0, "states_tracked": 0,
             "states_donated": 0, "states_evicted": 0, "replayssm_flushes": 0, "output_tokens": 1,
             "prompt_tokens_per_second": 1.0, "output_tokens_per_second": 1.0, "wall_seconds": 1.0,
             "peak_memory_bytes": 0,
             "eval": {"metric": "exact_match", "accuracy": 0.5, "stderr": 0.5, "judged": 2,
                      "examples": [{"id": "q7", "answer": "1046", "generated_text": " 1046", "correct": True},
                                   {"id": None, "answer": "9", "generated_text": "8", "correct": False}]}}
    render_summary(console, stats)
    text = console.file.getvalue()
    assert "q7: generated ' 1046', answer '1046': right" in text
    # a _stats.json without the computed prompt rate (written before it was recorded) still renders
    assert "prompt tok/s with cached (generation)" in text and "computed /" not in text
    console = Console(file=StringIO(), width=200)
    render_summary(console, {**stats, "computed_prompt_tokens_per_second": 0.5})
    assert "prompt tok/s: computed / with cached (generation)" in console.file.getvalue()
    assert "0.5 / 1.0" in console.file.getvalue()
    assert "generated '8', answer '9': wrong" in text


def error_of(text: str) -> str:
    with pytest.raises(JobError) as caught:
        parse_job_file(text, Path("/p/jobs.yaml"))
    return str(caught.value)


JOB = """
jobs:
  - name: e
    model: demo
    input: d.parquet
    prompt: {column: q}
"""


@pytest.mark.parametrize("extra, where, what", [
    ("    eval: {metric: exact_match}", "jobs.e.eval.answer_column", "missing"),
    ("    eval: {answer_column: a, metric: f1}", "jobs.e.eval.metric", "must be one of"),
    ("    eval: {answer_column: a, metric: choice_accuracy}", "jobs.e.eval.metric", "needs task: score"),
    ("    eval: {answer_column: a, normalize: {lowercase: 1}}", "jobs.e.eval.normalize.lowercase", "true or false"),
    ("    eval: {answer_column: a, normalize: {lower: true}}", "jobs.e.eval.normalize.lower", "did you mean"),
    ("    task: score", "jobs.e.score.continuations_column", "missing"),
    ("    score: {continuations_column: c}", "jobs.e.score", "needs task: score"),
    ("    task: score\n    score: {continuations_column: c}\n    eval: {answer_column: a}", "jobs.e.eval.metric",
     "use choice_accuracy"),
    ("    task: classify", "jobs.e.task", "must be one of generate, score"),
])
def test_task_and_eval_mistakes_are_one_located_line(extra, where, what):
    message = error_of(JOB + extra + "\n")
    assert where in message and what in message and "\n" not in message


def test_eval_columns_are_checked_before_anything_runs(tmp_path, checkpoint):
    write_parquet(pa.table({"question": ["q"], "answer": [3]}), tmp_path / "data" / "rag.parquet")
    for eval_settings, what in [({"answer_column": "answr"}, "did you mean 'answer'"),
                                ({"answer_column": "answer"}, "must be text or a list of text")]:
        job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), prompt={"template": "{question}"},
                                                       eval=eval_settings)])
        with pytest.raises(JobError) as caught:
            prepare_job(load_job_file(job_file).jobs[0])
        assert "eval.answer_column" in str(caught.value) and what in str(caught.value)
